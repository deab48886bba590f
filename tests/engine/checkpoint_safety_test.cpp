// Checkpoints against hostile input (issue 27): tags that would escape their
// folder, keep_last, edits of any file, a load that fails half way, two
// processes on one folder. Each test failed before its fix.
#include <gtest/gtest.h>

#include <mutex>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "core/error.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "tests/engine/checkpoint_util.h"

namespace zinc {
namespace {

namespace fs = std::filesystem;

std::string fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "zinc-safety-" + name;
  fs::remove_all(dir);
  return dir;
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// The error of `fn`, or "" if it did not throw.
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// An engine and loader for the small GPT of checkpoint_util.h.
struct Trainer {
  testing_train::RunSpec spec;
  Engine engine;
  DataLoader loader;
  Trainer()
      : engine(Engine::initialize(testing_train::make_model(spec.model), testing_train::make_config(spec))),
        loader(source(), spec.global_batch, 1, 1, 0, 7) {}
  static std::shared_ptr<const DataSource> source() {
    DataConfig dc;
    dc.vocab_size = 13;
    dc.seq_len = 9;
    return std::shared_ptr<const DataSource>(make_data_source(dc));
  }
  void train(int steps) {
    for (int s = 0; s < steps; ++s) engine.train_batch(loader);
  }
};

// Item 1: a tag is one safe folder name. A NUL byte (which cut the partial
// folder's path to the checkpoint folder itself, and the save removed every
// checkpoint in it), "latest" (which replaced the `latest` file by a
// folder), a trailing space (saved, then unreadable through `latest`), a
// path: each is refused before anything is written, and the folder's
// checkpoints stay.
TEST(CheckpointSafety, UnsafeTagsAreRefusedAndNothingIsRemoved) {
  const std::string dir = fresh("tags");
  Trainer run;
  run.train(1);
  run.engine.save_checkpoint(dir);
  const std::set<std::string> before = entries(dir);
  for (const std::string& bad :
       {std::string("\0", 1), std::string("a\0b", 3), std::string("latest"), std::string("step1 "), std::string(" x"),
        std::string("../escape"), std::string("a/b"), std::string(".hidden"), std::string("-x"), std::string(""),
        std::string(201, 'a'), std::string("caf\xc3\xa9"), std::string("tab\there")}) {
    if (bad.empty()) continue;  // "" means the default tag
    const std::string what = error_of([&] { run.engine.save_checkpoint(dir, bad); });
    EXPECT_NE(what.find("checkpoint tag"), std::string::npos) << "tag of " << bad.size() << " bytes: " << what;
    EXPECT_NE(what.find("A-Z a-z 0-9 . _ - +"), std::string::npos) << what;
    EXPECT_EQ(entries(dir), before) << what;
  }
  EXPECT_EQ(read_text(dir + "/latest"), "global_step1\n");
  for (const std::string good : {"best", "step_1.5", "v2+ft", "_x", "9"}) EXPECT_NO_THROW(ckpt::check_tag(good)) << good;
  run.engine.load_checkpoint(dir);  // still whole
}

// A save of a tag whose folder zinc did not write (a user's folder, a file,
// DeepSpeed's checkpoint of the same name) is refused naming it, and what is
// there stays: the save swapped it out and removed it. A zinc tag of the
// same name is replaced as before.
TEST(CheckpointSafety, ASaveNeverReplacesAFolderZincDidNotWrite) {
  const std::string dir = fresh("foreign");
  Trainer run;
  run.train(1);
  fs::create_directories(dir + "/data");
  write_text(dir + "/data/train.txt", "the user's");
  write_text(dir + "/notes", "a file");
  fs::create_directories(dir + "/global_step1");
  write_text(dir + "/global_step1/mp_rank_00_model_states.pt", "deepspeed");
  for (const std::string tag : {"data", "notes", "global_step1"}) {
    const std::string what = error_of([&] { run.engine.save_checkpoint(dir, tag); });
    EXPECT_NE(what.find("is not a zinc checkpoint tag"), std::string::npos) << tag << ": " << what;
    EXPECT_NE(what.find(dir + "/" + tag), std::string::npos) << what;
  }
  EXPECT_EQ(read_text(dir + "/data/train.txt"), "the user's");
  EXPECT_EQ(read_text(dir + "/notes"), "a file");
  EXPECT_EQ(read_text(dir + "/global_step1/mp_rank_00_model_states.pt"), "deepspeed");
  EXPECT_FALSE(fs::exists(dir + "/latest"));
  run.engine.save_checkpoint(dir, "mine");
  run.train(1);
  run.engine.save_checkpoint(dir, "mine");  // its own tag: replaced
  EXPECT_EQ(read_text(dir + "/latest"), "mine\n");
}

// A file system without RENAME_EXCHANGE re-saves a tag with two renames,
// the old folder aside to .TAG.old first: a kill between them left `latest`
// naming no folder, and resume and export failed ("edited or damaged")
// with the tag's previous copy whole beside it. That copy loads, and the
// next save of the tag removes it.
TEST(CheckpointSafety, ATagLeftAsideByAStoppedFallbackSaveLoads) {
  const std::string dir = fresh("aside");
  Trainer run;
  run.train(2);
  run.engine.save_checkpoint(dir);
  const std::vector<float> saved = run.engine.full_params(1);
  fs::rename(dir + "/global_step2", dir + "/.global_step2.old");  // as the kill leaves it
  Trainer other;
  other.engine.load_checkpoint(dir);
  EXPECT_EQ(other.engine.full_params(1), saved);
  EXPECT_EQ(other.engine.global_steps(), 2);
  other.engine.save_checkpoint(dir);  // the tag again, whole: the copy aside goes
  EXPECT_TRUE(fs::exists(dir + "/global_step2/metadata.json"));
  EXPECT_FALSE(fs::exists(dir + "/.global_step2.old"));
}

// Item 2: keep_last after a save into a folder that holds later steps of
// another run: the new save, which `latest` names, stays; nothing of a
// higher step is removed; older ones beyond keep go.
TEST(CheckpointSafety, KeepLastNeverRemovesTheNewestSave) {
  const std::string dir = fresh("prune");
  Trainer run;
  run.train(1);
  for (const char* tag : {"global_step38", "global_step40", "global_step1", "global_step2", "global_step3"})
    run.engine.save_checkpoint(dir, tag);
  run.engine.save_checkpoint(dir, "global_step4");
  EXPECT_EQ(ckpt::prune(dir, 2, "global_step4"), (std::vector<std::string>{"global_step2", "global_step1"}));
  EXPECT_EQ(entries(dir), (std::set<std::string>{".zinc.lock", "global_step3", "global_step4", "global_step38",
                                                  "global_step40", "latest"}));
  EXPECT_EQ(read_text(dir + "/latest"), "global_step4\n");
  run.engine.load_checkpoint(dir);
  // keep 1: only the newest save of this line, and never what `latest` names.
  write_text(dir + "/latest", "global_step3\n");
  EXPECT_TRUE(ckpt::prune(dir, 1, "global_step4").empty());
  EXPECT_TRUE(fs::exists(dir + "/global_step3"));
  // A folder that is not a complete checkpoint is not pruned, nor one of
  // the user's that happens to end in ".pruned"; a crash's leftover is.
  fs::create_directory(dir + "/global_step0");
  fs::create_directory(dir + "/.mine.pruned");
  fs::create_directory(dir + "/.global_step7.pruned");
  write_text(dir + "/latest", "global_step4\n");
  EXPECT_EQ(ckpt::prune(dir, 1, "global_step4"), std::vector<std::string>{"global_step3"});
  EXPECT_TRUE(fs::exists(dir + "/global_step0"));
  EXPECT_TRUE(fs::exists(dir + "/.mine.pruned"));
  EXPECT_FALSE(fs::exists(dir + "/.global_step7.pruned"));
}

// Item 3: every file is checksummed and the indexes are checked before a
// load. Each edit below loaded shifted or zero weights with no error before.
TEST(CheckpointSafety, AnEditOfAnyFileIsAnErrorNamingIt) {
  const std::string dir = fresh("edits");
  Trainer run;
  run.train(2);
  run.engine.save_checkpoint(dir);
  const std::string tag = dir + "/global_step2";
  const std::string meta = read_text(tag + "/metadata.json"), index = read_text(tag + "/rank00000.json");
  auto expect_refused = [&](const std::string& what, const std::string& file, const std::string& text,
                            const std::string& want) {
    write_text(tag + "/" + file, text);
    Trainer other;
    const std::string err = error_of([&] { other.engine.load_checkpoint(dir); });
    EXPECT_NE(err.find(file), std::string::npos) << what << ": " << err;
    EXPECT_NE(err.find(want), std::string::npos) << what << ": want '" << want << "' in " << err;
    EXPECT_EQ(error_of([&] { ckpt::open_tag(dir, ""); }), err) << what << " (zinc-export opens a tag the same way)";
    write_text(tag + "/metadata.json", meta);
    write_text(tag + "/rank00000.json", index);
  };
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? s : s.replace(at, from.size(), to);
  };
  // A one-character edit of the index: another flat_offset.
  const std::string shifted = replace(index, "\"flat_offset\":0", "\"flat_offset\":1");
  expect_refused("flat_offset edited", "rank00000.json", shifted, "is corrupted");
  // The metadata: a changed step counter, an emptied rank_indexes, a
  // changed learning rate.
  expect_refused("step edited", "metadata.json", replace(meta, "\"global_steps\": 2", "\"global_steps\": 3"),
                 "checksum does not match");
  expect_refused("rank_indexes emptied", "metadata.json",
                 meta.substr(0, meta.find("\"rank_indexes\"")) + "\"rank_indexes\": [],\n" +
                     meta.substr(meta.find("\"tag\"")),
                 "checksum does not match");
  expect_refused("not JSON", "metadata.json", meta.substr(0, meta.size() / 2), "not valid JSON");
  // Whitespace is not content: a reformatted metadata still loads.
  write_text(tag + "/metadata.json", nlohmann::json::parse(meta).dump(4));
  Trainer reformatted;
  EXPECT_NO_THROW(reformatted.engine.load_checkpoint(dir));
  write_text(tag + "/metadata.json", meta);
  // An index whose checksum the metadata vouches for but whose content is
  // inconsistent can only come from a writer's bug: checked all the same,
  // by sealing an edited document (what a careful attacker would write).
  nlohmann::json m = nlohmann::json::parse(meta);
  nlohmann::json ix = nlohmann::json::parse(index);
  ix["blocks"][0]["flat_offset"] = 1;
  const std::string ix_text = ix.dump();
  m.erase(ckpt::kSealKey);
  m["rank_indexes"][0]["bytes"] = ix_text.size();
  m["rank_indexes"][0]["xxh3_64"] = ckpt::xxh3_hex(ix_text.data(), ix_text.size());
  write_text(tag + "/rank00000.json", ix_text);
  write_text(tag + "/metadata.json", ckpt::sealed_dump(m, 1));
  {
    Trainer other;
    const std::string err = error_of([&] { other.engine.load_checkpoint(dir); });
    EXPECT_NE(err.find("has no saved elements"), std::string::npos) << err;
  }
  write_text(tag + "/metadata.json", meta);
  write_text(tag + "/rank00000.json", index);
  Trainer whole;
  EXPECT_NO_THROW(whole.engine.load_checkpoint(dir));
  EXPECT_EQ(testing_train::all_weights(whole.engine), testing_train::all_weights(run.engine));
  // `latest` cut or edited into another valid tag name (found by
  // crash_consistency.py): named as the damaged file, not as a missing tag.
  for (const std::string bad : {"global_st\n", "wlobal_step2\n", "g"}) {
    write_text(dir + "/latest", bad);
    const std::string err = error_of([&] { ckpt::open_tag(dir, ""); });
    EXPECT_NE(err.find(dir + "/latest names \""), std::string::npos) << err;
    EXPECT_NE(err.find("edited or damaged"), std::string::npos) << err;
  }
}

// Checkpoints of format version 1 (before every file was checksummed) still
// load, with their structure checked; a cut shard file is named as cut.
TEST(CheckpointSafety, VersionOneCheckpointsStillLoad) {
  const std::string dir = fresh("v1");
  Trainer run;
  run.train(2);
  run.engine.save_checkpoint(dir);
  const std::string tag = dir + "/global_step2";
  nlohmann::json meta = read_json_file(tag + "/metadata.json");
  meta.erase(ckpt::kSealKey);
  meta["version"] = 1;
  meta["rank_indexes"] = nlohmann::json::array({"rank00000.json"});
  write_text(tag + "/metadata.json", meta.dump(1));
  nlohmann::json index = read_json_file(tag + "/rank00000.json");
  index.erase("file_bytes");
  write_text(tag + "/rank00000.json", index.dump());
  Trainer loaded;
  loaded.engine.load_checkpoint(dir);
  EXPECT_EQ(testing_train::all_weights(loaded.engine), testing_train::all_weights(run.engine));
  fs::resize_file(tag + "/rank00000.bin", 5000);
  Trainer other;
  const std::string err = error_of([&] { other.engine.load_checkpoint(dir); });
  EXPECT_NE(err.find("rank00000.bin is truncated: it has 5000 bytes, and block '"), std::string::npos) << err;
}

// Item 4: a load that fails while reading (a chunk whose checksum does not
// match) leaves an engine that refuses to train or save until a load
// succeeds; one that fails in the verification changes nothing.
TEST(CheckpointSafety, AFailedLoadIsAllOrNothing) {
  const std::string good = fresh("load-good"), bad = fresh("load-bad");
  Trainer saver;
  saver.train(2);
  saver.engine.save_checkpoint(good);
  saver.engine.save_checkpoint(bad);
  const std::vector<float> saved = testing_train::all_weights(saver.engine);
  // Flip a byte of the last block's Adam v: read after every other state.
  const nlohmann::json index = read_json_file(bad + "/global_step2/rank00000.json");
  const std::string bin = bad + "/global_step2/rank00000.bin";
  std::string bytes = read_text(bin);
  bytes[index["blocks"].back()["v"]["file_offset"].get<size_t>() + 8] ^= 0x20;
  write_text(bin, bytes);

  Trainer run;
  run.train(1);
  const std::vector<float> before = testing_train::all_weights(run.engine);
  // A verification failure (a missing index) changes nothing: training goes on.
  const std::string noindex = fresh("load-noindex");
  fs::copy(bad, noindex, fs::copy_options::recursive);
  fs::remove(noindex + "/global_step2/rank00000.json");
  EXPECT_NE(error_of([&] { run.engine.load_checkpoint(noindex); }).find("rank00000.json not found"), std::string::npos);
  EXPECT_EQ(testing_train::all_weights(run.engine), before);
  // A chunk that fails while reading: the engine refuses until a good load.
  const std::string err = error_of([&] { run.engine.load_checkpoint(bad); });
  EXPECT_NE(err.find("rank00000.bin is corrupted"), std::string::npos) << err;
  const std::string save_dir = fresh("load-save");
  for (const std::string& refused :
       {error_of([&] { run.train(1); }), error_of([&] { run.engine.save_checkpoint(save_dir); }),
        error_of([&] { run.engine.full_params(0); })}) {
    EXPECT_NE(refused.find("the engine's state is incomplete after a failed load"), std::string::npos) << refused;
    EXPECT_NE(refused.find("rank00000.bin is corrupted"), std::string::npos) << refused;
  }
  EXPECT_FALSE(fs::exists(save_dir));
  run.engine.load_checkpoint(good);
  EXPECT_EQ(testing_train::all_weights(run.engine), saved);
  EXPECT_NO_THROW(run.train(1));
}

// Item 5: a second process on a locked folder is refused, naming the
// folder and the holder's pid; the lock goes with its holder.
TEST(CheckpointSafety, TwoProcessesCannotWriteOneFolder) {
  const std::string dir = fresh("lock");
  int to_child[2], to_parent[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(to_parent), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // holds the lock until told to let go
    {
      ckpt::DirLock lock(dir);
      char c = 'l';
      if (::write(to_parent[1], &c, 1) != 1) ::_exit(2);
      if (::read(to_child[0], &c, 1) != 1) ::_exit(3);
    }
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(to_parent[0], &c, 1), 1);
  const std::string err = error_of([&] { ckpt::DirLock second(dir); });
  EXPECT_NE(err.find("is in use by another run"), std::string::npos) << err;
  EXPECT_NE(err.find("pid " + std::to_string(child)), std::string::npos) << err;
  EXPECT_NE(err.find(dir), std::string::npos) << err;
  // A save by an engine of this process is refused the same way, and writes nothing.
  Trainer run;
  run.train(1);
  EXPECT_NE(error_of([&] { run.engine.save_checkpoint(dir); }).find("is in use by another run"), std::string::npos);
  EXPECT_EQ(entries(dir), std::set<std::string>{".zinc.lock"});
  ASSERT_EQ(::write(to_child[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // Free again; within one process the lock is shared (a run holds it and
  // its saves take it again).
  ckpt::DirLock mine(dir);
  EXPECT_NO_THROW(run.engine.save_checkpoint(dir));
  // An uncreatable folder is named.
  const std::string unwritable = error_of([&] { ckpt::DirLock l("/proc/zinc-no/ck"); });
  EXPECT_NE(unwritable.find("/proc/zinc-no/ck"), std::string::npos) << unwritable;
}

// Note [two writers in one process]: a second run of this process on a
// held folder is refused as another process's would be, while the run's
// own saves pass; two engines of one process saving into one folder at
// once take turns (they shared DIR/.TAG.partial, and `latest` ended at a
// tag without its metadata: nothing loaded).
TEST(CheckpointSafety, TwoWritersInOneProcessNeitherMixNorShareARun) {
  const std::string dir = fresh("inproc");
  {
    ckpt::DirLock run(dir, "checkpoint folder", "", ckpt::LockUse::kRun);
    const std::string err = error_of([&] { ckpt::DirLock second(dir, "checkpoint folder", "", ckpt::LockUse::kRun); });
    EXPECT_NE(err.find("is in use by another run of this process"), std::string::npos) << err;
    EXPECT_NE(err.find(dir), std::string::npos) << err;
    Trainer own;
    own.train(1);
    EXPECT_NO_THROW(own.engine.save_checkpoint(dir));  // a save inside the run
  }
  EXPECT_NO_THROW(ckpt::DirLock(dir, "checkpoint folder", "", ckpt::LockUse::kRun));  // released with its run
  Trainer a, b;
  a.train(2);
  b.train(3);
  a.engine.save_checkpoint(dir, "same");
  std::vector<std::string> errors;
  std::mutex m;
  auto saves = [&](Trainer& t) {
    for (int i = 0; i < 10; ++i) {
      try {
        t.engine.save_checkpoint(dir, "same");
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(m);
        errors.push_back(e.what());
      }
    }
  };
  std::thread ta(saves, std::ref(a)), tb(saves, std::ref(b));
  ta.join();
  tb.join();
  EXPECT_TRUE(errors.empty()) << errors.front();
  Trainer c;
  EXPECT_NO_THROW(c.engine.load_checkpoint(dir, "same"));
  EXPECT_NO_THROW(c.engine.load_checkpoint(dir, ""));  // through `latest`
  EXPECT_TRUE(c.engine.global_steps() == 2 || c.engine.global_steps() == 3) << c.engine.global_steps();
}

}  // namespace
}  // namespace zinc
