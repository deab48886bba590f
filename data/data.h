// zinc data: training data. A DataSource yields (inputs, targets) token
// micro-batches; a DataLoader splits each global batch between data-parallel
// ranks (no overlap, nothing skipped) and reshuffles per epoch.
//
// Sources:
// - synthetic: an infinite, seeded stream with a known entropy floor. Each
//   sample is an independent sequence x_0..x_T: x_0 uniform; x_1 uniform;
//   then x_t depends on (x_{t-2}, x_{t-1}) through a seeded table (see
//   SyntheticSource). A model reaches the floor only by using both previous
//   tokens.
// - text: the bytes of a file are the tokens (vocabulary 256), read whole
//   at open.
// - tokens: a flat file of little-endian uint16 or uint32 tokens, as the
//   common GPT training scripts write, optionally after their 256 x int32
//   header, which states the width: magic 20240520 version 1 is uint16 (the
//   GPT-2 files), magic 20240801 version 7 is uint32 (the Llama 3 files,
//   whose 128k vocabulary does not fit 16 bits). A file without a header
//   holds data.token_dtype tokens (uint16 unless stated). Read with pread,
//   one read per sample, never mapped: a file truncated under a running job
//   is an IoError naming it at the next sample, not a SIGBUS.
//   Two optional files beside it, as `python -m zinc.prepare` writes them:
//   - a mask (data.mask_path): one byte per token, 1 where the token is a
//     target, 0 where it is not (a prompt); a target whose token has 0
//     becomes kIgnoreTarget;
//   - documents (data.documents_path): little-endian uint64 indices of the
//     tokens that begin a document, strictly increasing. A sample that
//     spans several documents gets Batch::positions restarting at each,
//     and the target crossing into a document is kIgnoreTarget.
// Data files must be regular files: a FIFO, device or directory is refused
// at open, without blocking.
// Thread-safety: a DataLoader is used from one thread; a source's sample()
// may be called from several.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zinc {

// A target that is not one (transformers' ignore_index): the position adds
// nothing to the loss or the gradients, and the loss is the mean over the
// targets that remain (the engine's normaliser is their count over the
// whole global batch, all ranks and micro-batches, as the HF Trainer's).
constexpr int32_t kIgnoreTarget = -100;

// One micro-batch of token sequences: inputs and next-token targets, (B,T).
struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;    // in [0, V), or kIgnoreTarget
  // Packed documents: empty (each row is one sequence), or B*T positions,
  // transformers' position_ids: each row starts at 0, and each next one is
  // 0 (a new document begins at that token) or the previous + 1. Attention
  // stays inside a document and positions (learned or rotary) restart at
  // each. The target crossing into the next document is the caller's to
  // mask (the token sources do).
  std::vector<int32_t> positions;
};

// The kind of source (see the list above).
enum class DataType { kSynthetic, kText, kTokens };
const char* data_type_name(DataType t);  // "synthetic" | "text" | "tokens"

struct DataConfig {
  DataType type = DataType::kSynthetic;
  std::string path;                // text / tokens: the file
  int64_t seq_len = 256;           // T: tokens per sample (inputs; targets shifted by one)
  // synthetic: V (2..8192). tokens: if > 0, every token must be < V (checked
  // at load); <= 0 takes max token + 1 from the file. text: ignored (256).
  int64_t vocab_size = 64;         // V
  // tokens: bytes per token, 2 (uint16) or 4 (uint32); 0: the header's, else
  // 2. A width that disagrees with the file's header is an error.
  int64_t token_bytes = 0;
  std::string mask_path;           // tokens: the per-token mask file; "" for none
  std::string documents_path;      // tokens: the document starts file; "" for none
  // synthetic only:
  double determinism = 0.8;        // p: probability that x_t = table(x_{t-2}, x_{t-1})
  uint64_t seed = 1234;            // the source's table and samples (not the model's init)
  // text / tokens: fraction of samples held out for evaluation (the tail).
  double eval_fraction = 0.0;

  bool operator==(const DataConfig&) const = default;
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual std::string describe() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t seq_len() const = 0;
  // Number of distinct samples per epoch; the synthetic source reports a
  // large fixed epoch (its samples are indexed, not stored).
  virtual int64_t num_samples() const = 0;
  // Writes sample `index` (0 <= index < num_samples()): T inputs, T targets.
  // Throws IoError when the file behind the source has shrunk since it was
  // opened, naming the file, the bytes wanted and its size now.
  // A target that is not one (a masked prompt token, the first token of a
  // document) is kIgnoreTarget.
  virtual void sample(int64_t index, int32_t* inputs, int32_t* targets) const = 0;
  // Whether samples carry document positions (Batch::positions); then
  // positions(index, out) writes sample index's T of them.
  virtual bool has_positions() const { return false; }
  virtual void positions(int64_t index, int32_t* out) const {}
  // Exact entropy floor of the mean next-token loss in nats, if known.
  virtual std::optional<double> loss_floor() const { return std::nullopt; }
};

// Throws zinc::IoError (a missing, unreadable or not regular file, naming it
// and "data.path") or zinc::ConfigError.
// text / tokens: the head of the file, without the eval_fraction tail.
std::unique_ptr<DataSource> make_data_source(const DataConfig& cfg);
// The held-out evaluation samples: text / tokens, the eval_fraction tail of
// the file (nullptr when eval_fraction is 0); synthetic, a disjoint seeded
// range of samples from the same distribution. Same errors as above.
std::unique_ptr<DataSource> make_eval_data_source(const DataConfig& cfg);
// The same, beside `train`, the source make_data_source(cfg) made: the
// evaluation then shares its open files and what its open checked
// (Note [the held-out twin] in data.cpp), instead of reading the whole
// token file and mask again. A `train` made from another config is not
// shared.
std::unique_ptr<DataSource> make_eval_data_source(const DataConfig& cfg, const DataSource& train);

// Sample `index` of `source` as row b of `batch` (B*T inputs, targets and,
// where the source has them, positions, sized by the caller).
void read_sample(const DataSource& source, int64_t index, Batch& batch, int64_t b);

// Walks a DataSource in global batches of `global_batch` samples, each split
// into `world_size` equal parts; rank r takes part r, in micro-batches of
// `micro_batch` samples. The order is a seeded permutation of the source's
// samples, redrawn every epoch (shuffle_seed, epoch); every rank computes the
// same permutation, so no rank reads a sample another rank reads in the same
// epoch.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const DataSource> source, int64_t micro_batch, int64_t grad_accum,
             int world_size, int rank, uint64_t shuffle_seed);
  // Next micro-batch for this rank (B = micro_batch).
  Batch next();
  // Epoch of the last sample read (after construction / set_position: of the next one).
  int64_t epoch() const { return epoch_; }
  int64_t micro_batch() const { return micro_batch_; }
  const DataSource& source() const { return *source_; }
  // Consumed samples (all ranks) so far; restoring it resumes the order exactly.
  int64_t position() const { return position_; }
  void set_position(int64_t samples);
  // Throws what set_position would for `samples`, changing nothing (a
  // resume checks it before the engine reads the checkpoint).
  void check_position(int64_t samples) const;

 private:
  void reshuffle();
  std::shared_ptr<const DataSource> source_;
  int64_t micro_batch_, grad_accum_;
  int world_size_, rank_;
  uint64_t shuffle_seed_;
  int64_t epoch_ = -1;
  int64_t position_ = 0;   // global samples consumed
  std::vector<int64_t> order_;  // permutation of epoch_ (empty: too large to hold, computed per position)
};

}  // namespace zinc
