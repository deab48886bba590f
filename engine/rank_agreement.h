// Whether every rank was given the same thing (a config, the command line,
// the files a run reads, the checkpoint it resumes): ranks that differ train
// diverging shards, or wait in collectives the others never issue. One
// all-reduce compares a digest (a cut 64-bit hash in two exact halves, as
// max(x) == -max(-x) only when all are equal); where they differ, rank 0's
// and the lowest differing rank's documents go to every rank, which all
// reach the same answer and can stop with the same error naming the first
// differing key.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/comm.h"

namespace zinc {

struct RankDifference {
  std::string path;      // dotted, "a.b[2].c"; "" where the documents themselves differ
  std::string at_root;   // rank 0's value, cut short ("nothing" where it has no such key)
  std::string at_other;  // the other rank's
  int other = 0;         // the lowest rank whose document differs from rank 0's
};

// Collective over `comm`: every rank passes its own document. nullopt where
// all equal rank 0's as JSON values (1 and 1.0 are the same number); else
// the first difference, the same on every rank.
std::optional<RankDifference> rank_difference(comm::Communicator& comm, const nlohmann::json& mine);

// `text` of rank `root` on every rank (collective).
std::string broadcast_text(comm::Communicator& comm, const std::string& text, int root);

// The first place where a and b differ (depth first, keys in order), its
// dotted path and both values (cut short); false where they are equal.
bool first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at, std::string& path,
                      std::string& va, std::string& vb);

}  // namespace zinc
