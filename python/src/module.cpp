// zinc Python module (_zinc, re-exported by the package `zinc`): the engine
// and config-only training runs over the same C++ code as zinc-train.
//
// Threads and signals: every call that computes (initialize, forward,
// backward, step, train_batch, evaluate, checkpoints) runs inside a
// ComputeScope: the GIL released and SIGINT / SIGTERM blocked on the calling
// thread. Threads the engine starts (OpenMP pool, comm streams, I/O reapers)
// are started inside such a scope and inherit the blocked mask, so a Ctrl-C
// is never delivered onto a thread running oneDNN's JIT code (zinc-train's
// comment on its signal thread says why that matters); it stays pending until
// the scope ends, Python's handler then sets its flag, and the
// KeyboardInterrupt is raised at that call boundary, between steps, with the
// engine intact.
//
// Note [one call at a time]
// The engine is not thread-safe, and a call that released the GIL leaves
// every other Python thread free to call in (or to close it) meanwhile, which
// crashed the interpreter. So every call that touches an engine holds its
// PyEngine::Call for its whole length, and a second call while one is in
// (from another thread, or from the same thread, e.g. out of the data
// iterable train_batch reads) is refused with RuntimeError: "zinc.Engine.
// forward: another thread is inside Engine.train_batch; an engine is driven
// by one thread at a time". Refused, not queued: a queued call would
// interleave two threads' forward/backward/step sequences, which trains
// nonsense silently. zinc.train's run holds the same Call for each step.
// close() never fails and never frees an engine under a running call: with
// a call in, it marks the engine closed (every later call raises
// ValueError, `closed` is True) and returns at once, and the running call
// frees the engine as it returns. close() must not raise because it runs
// from __exit__, from the destructor and from _shutdown at exit.
//
// MPI (Note [MPI lifetime] in comm/mpi_communicator.cpp): under mpirun the
// first initialize() makes the process's communicator and keeps it for the
// life of the process, because MPI cannot start again once finalised;
// zinc._shutdown (registered with atexit) closes every engine and lets it go.
#include <csignal>
#include <unistd.h>
#include <pthread.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/error.h"
#include "core/log.h"
#include "data/data.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "python/src/unconstructed.h"
#include "tools/experiment.h"
#include "tools/hf_model.h"
#include "tools/monitor.h"
#include "tools/resources.h"
#include "tools/peft_adapter.h"
#include "tools/safetensors.h"
#include "tools/run_loop.h"
#include "tools/train_events.h"

#include "convert.h"

namespace py = pybind11;
using json = nlohmann::json;

void bind_optim(py::module_& m);  // optim.cpp: zinc.optim
void bind_bench(py::module_& m);  // bench.cpp: zinc._zinc._bench (private)

#ifndef ZINC_VERSION
#error "ZINC_VERSION must be defined by the build (python/CMakeLists.txt)"
#endif

namespace {

using zinc::python::from_py;
using zinc::python::load_config;
using zinc::python::to_py;
using zinc::python::type_name;

// ---- exceptions ----------------------------------------------------------

PyObject* g_error = nullptr;         // zinc.Error(RuntimeError)
PyObject* g_config_error = nullptr;  // zinc.ConfigError(ValueError), .path
PyObject* g_comm_error = nullptr;    // zinc.CommError(zinc.Error)

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const zinc::ConfigError& e) {
    py::object exc = py::reinterpret_borrow<py::object>(g_config_error)(e.what());
    exc.attr("path") = e.path();
    PyErr_SetObject(g_config_error, exc.ptr());
  } catch (const zinc::IoError& e) {
    PyErr_SetString(PyExc_OSError, e.what());
  } catch (const zinc::CommError& e) {
    PyErr_SetString(g_comm_error, e.what());
  } catch (const zinc::Error& e) {
    PyErr_SetString(g_error, e.what());
  } catch (const nlohmann::json::exception& e) {
    // A document that is not what the config parser expects at a place it
    // did not check by path (should be rare): still a config error.
    py::object exc = py::reinterpret_borrow<py::object>(g_config_error)(std::string("config: ") + e.what());
    exc.attr("path") = "";
    PyErr_SetObject(g_config_error, exc.ptr());
  }
}

// ---- GIL and signals -----------------------------------------------------

// See the header comment: GIL released, SIGINT / SIGTERM blocked on this
// thread for the scope. Destruction restores the mask (a pending Ctrl-C is
// taken by Python's handler here) and then takes the GIL back.
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class ComputeScope {
 public:
  ComputeScope() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, &old_);
    release_.emplace();
  }
  ~ComputeScope() {
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    // A daemon thread whose call ends after the interpreter began to
    // finalise (the main thread returned while it trained) must not take
    // the GIL back: CPython would end the thread with pthread_exit, whose
    // unwinding through this destructor is std::terminate (SIGABRT at
    // exit). It waits here for the process to end instead (what CPython
    // 3.14 does to such threads itself).
    if (interpreter_finalizing())
      for (;;) ::pause();
    release_.reset();
  }
  ComputeScope(const ComputeScope&) = delete;
  ComputeScope& operator=(const ComputeScope&) = delete;

 private:
  sigset_t old_{};
  std::optional<py::gil_scoped_release> release_;
};

// Raises KeyboardInterrupt (or whatever a Python signal handler raised) now,
// at a step boundary, with the GIL held.
void check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// ---- the process's communicator ------------------------------------------

std::shared_ptr<zinc::comm::Communicator> g_comm;  // under mpirun: kept for the process (MPI starts once)

// The communicator for an engine: null with one rank; under an MPI launcher
// the process's, made from the first document's comm section.
std::shared_ptr<zinc::comm::Communicator> communicator_for(const json& doc) {
  if (!zinc::comm::launched_with_mpi()) return nullptr;
  if (!g_comm) {
    const zinc::tools::CommConfig cc = zinc::tools::ExperimentConfig::parse_comm(doc);
    g_comm = zinc::comm::make_communicator(zinc::tools::comm_backend_name(cc.backend), cc.timeout_seconds);
    zinc::set_log_rank(g_comm->rank());
    if (g_comm->rank() != 0 && zinc::log_level() < zinc::LogLevel::kWarn) zinc::set_log_level(zinc::LogLevel::kWarn);
  }
  return g_comm;
}

// ---- batches from NumPy --------------------------------------------------

// One (B,T) int32 array, checked: the argument's name in every error.
py::array_t<int32_t> token_array(py::handle h, const std::string& fn, const char* name) {
  if (!py::isinstance<py::array>(h))
    throw py::type_error(fn + ": " + name + " must be a numpy.ndarray of int32 with shape (B, T), got " +
                         type_name(h));
  // A masked array's mask would be dropped without a word, its masked
  // targets trained on.
  if (py::hasattr(h, "mask") && py::hasattr(h, "filled"))
    throw py::type_error(fn + ": " + name + " is a numpy.ma masked array, whose mask zinc does not read; mask a "
                         "target with -100 (targets.filled(-100)), and pass a plain ndarray");
  py::array a = py::reinterpret_borrow<py::array>(h);
  const char order = a.dtype().byteorder();  // '=' native, '<' or '>' written out ('<' is x86's own)
  const uint16_t one = 1;
  const bool swapped = order == (*reinterpret_cast<const unsigned char*>(&one) == 1 ? '>' : '<');
  if (a.dtype().kind() != 'i' || a.itemsize() != 4 || swapped)
    throw py::type_error(fn + ": " + name + " must have dtype int32" +
                         (swapped ? " in this machine's byte order, got " + std::string(py::str(a.dtype())) +
                                        " (its bytes are swapped; a.astype(numpy.int32) makes a copy in this "
                                        "machine's order)"
                                  : ", got " + std::string(py::str(a.dtype()))));
  if (a.ndim() != 2)
    throw py::value_error(fn + ": " + name + " must have 2 dimensions (B, T), got " + std::to_string(a.ndim()));
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(fn + ": " + name +
                          " must be C-contiguous (numpy.ascontiguousarray makes a contiguous copy)");
  if (a.shape(0) <= 0 || a.shape(1) <= 0)
    throw py::value_error(fn + ": " + name + " must not be empty, got shape (" + std::to_string(a.shape(0)) + ", " +
                          std::to_string(a.shape(1)) + ")");
  return py::reinterpret_borrow<py::array_t<int32_t>>(a);
}

// ---- Engine --------------------------------------------------------------

class PyEngine;
class TrainRun;
std::set<PyEngine*> g_engines;  // open engines and runs, closed by _shutdown
std::set<TrainRun*> g_runs;
// Set by _shutdown: an engine closed then was closed by the interpreter's
// exit, not by its user (a daemon thread's next call says which).
bool g_shutting_down = false;

class PyEngine {
 public:
  explicit PyEngine(py::handle config, std::optional<int64_t> steps = std::nullopt,
                    const char* fn = "zinc.initialize", bool ignore_resources = true) {
    doc_ = load_config(config, steps, fn);
    comm_ = communicator_for(doc_);
    const int world = comm_ ? comm_->size() : 1;
    {
      ComputeScope scope;
      ex_ = zinc::tools::build_experiment(doc_, world);
      // The same data and weights on every rank under the config's paths.
      if (comm_ && world > 1) zinc::tools::agree_on_inputs(ex_, *comm_);
      // zinc.train's run that saves holds its checkpoint folder from the
      // start, as zinc-train does: an unwritable folder fails now, and a
      // second run on it is refused naming the holder's pid. Before the
      // engine exists, so that the ranks' agreement is the only collective.
      // It also checks the room for the run first, as zinc-train does.
      if (std::string(fn) == "zinc.train") {
        std::unique_ptr<zinc::comm::Communicator> single;
        zinc::comm::Communicator* c = comm_ ? comm_.get() : (single = zinc::comm::make_single_communicator()).get();
        if (!ignore_resources) zinc::tools::check_room(ex_, *c);
        if (ex_.experiment.run.checkpoint_interval > 0)
          folder_lock_ = zinc::tools::hold_checkpoint_dir(ex_.experiment.run, *c);
      }
      engine_.emplace(zinc::Engine::initialize(ex_.model, ex_.config, world > 1 ? comm_ : nullptr));
      // Note [monitors of a driven engine]. (zinc.train's run loop has its own.)
      if (std::string(fn) != "zinc.train") {
        monitors_ = std::make_unique<zinc::tools::Monitors>(ex_.config, comm_ ? comm_->rank() : 0);
        if (!monitors_->enabled()) monitors_.reset();
      }
      loader_ = std::make_unique<zinc::DataLoader>(ex_.data, ex_.config.train_micro_batch_size_per_gpu,
                                                   ex_.config.gradient_accumulation_steps,
                                                   engine_->data_parallel_size(), engine_->data_parallel_rank(),
                                                   ex_.experiment.run.seed);
    }
    // The model's vocabulary and context, which batches are checked against:
    // the Hugging Face config's where there is one (a from_pretrained model
    // takes tokens beyond a small default data section's vocabulary).
    const zinc::tools::ModelConfig& m = ex_.experiment.model;
    vocab_ = m.vocab_size > 0 ? m.vocab_size : ex_.data->vocab_size();
    max_t_ = 0;  // a model with no Hugging Face form (the mlp) takes any length
    if (ex_.hf) {  // a folder's model, or a built-in one in its family's terms
      vocab_ = ex_.hf->model->vocab_size();
      max_t_ = ex_.hf->model->max_positions();
    }
    g_engines.insert(this);
  }
  // No call can be in flight here: a running call's frame holds a reference
  // to the Python object, so the destructor waits for it.
  ~PyEngine() {
    g_engines.erase(this);
    close();
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  // The one call in flight on this engine (Note [one call at a time]): taken
  // with the GIL held before the call touches the engine, and held until it
  // returns, through its GIL-free ComputeScope. `name` is what the refusals
  // print, e.g. "zinc.Engine.forward".
  class Call {
   public:
    Call(PyEngine& e, std::string name) : e_(e) {
      std::lock_guard<std::mutex> lock(e.call_mu_);
      if (!e.in_call_.empty()) {
        if (e.call_thread_ == std::this_thread::get_id())
          throw std::runtime_error(name + ": called from inside " + e.in_call_ +
                                   " on the same thread (e.g. from the data it iterates); an engine runs "
                                   "one call at a time");
        throw std::runtime_error(name + ": another thread is inside " + e.in_call_ +
                                 "; an engine is driven by one thread at a time");
      }
      e.in_call_ = std::move(name);
      e.call_thread_ = std::this_thread::get_id();
    }
    ~Call() { e_.end_call(); }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    PyEngine& e_;
  };

  // The engine, for a call that holds this engine's Call on this thread.
  zinc::Engine& engine(const char* what) {
    {
      std::lock_guard<std::mutex> lock(call_mu_);
      ZINC_CHECK(!in_call_.empty() && call_thread_ == std::this_thread::get_id(),
                 std::string("zinc.Engine.") + what + " touches the engine without its Call");
    }
    if (!engine_)
      throw py::value_error(std::string("zinc.Engine.") + what +
                            (g_shutting_down ? ": the engine was closed at interpreter exit (the main thread ended "
                                               "while this thread still used it)"
                                             : ": the engine is closed"));
    if (forked())
      throw zinc::Error(std::string("zinc.Engine.") + what + ": this engine was made by process " +
                        std::to_string(owner_pid_) + ", which os.fork()ed this one; its threads (the optimizer's, "
                        "the collectives', the NVMe reapers) did not come along, so it cannot run here: make an "
                        "engine in this process (or start workers with the spawn method)");
    return *engine_;
  }
  // Note [engines across fork]: true in a child of the process that made
  // the engine. fork() copies the engine's memory but none of its threads,
  // so waiting for them (a step, a destructor joining them) waited for
  // ever: the child refuses every call, and its close() lets the copy go
  // without running its destructors (which would also remove the parent's
  // NVMe files and flush its monitors' files a second time).
  bool forked() const { return ::getpid() != owner_pid_; }
  // The properties: one read of the engine under a Call.
  template <class F>
  auto read(const char* what, F f) {
    Call call(*this, std::string("zinc.Engine.") + what);
    return f(engine(what));
  }

  // Frees the engine now, or, with a call in flight, when that call returns
  // (Note [one call at a time]). Never raises.
  void close() {
    {
      std::lock_guard<std::mutex> lock(call_mu_);
      if (!engine_) return;
      if (!in_call_.empty()) {
        close_pending_ = true;
        return;
      }
      in_call_ = "zinc.Engine.close";  // no call starts while the engine is freed
      call_thread_ = std::this_thread::get_id();
    }
    free_engine();
    std::lock_guard<std::mutex> lock(call_mu_);
    in_call_.clear();
    call_thread_ = {};
    close_pending_ = false;
  }
  bool closed() const {
    std::lock_guard<std::mutex> lock(call_mu_);
    return !engine_ || close_pending_;
  }
  // A call is in flight (on any thread).
  bool busy() const {
    std::lock_guard<std::mutex> lock(call_mu_);
    return !in_call_.empty();
  }

  float forward(py::object batch) {
    zinc::Engine& e = engine("forward");
    if (batch.is_none()) {
      check_config_batch("zinc.Engine.forward");
      ComputeScope scope;
      return note_loss(e.forward(loader_->next()));
    }
    zinc::Batch b = to_batch(batch, "zinc.Engine.forward");
    ComputeScope scope;
    return note_loss(e.forward(b));
  }
  // forward(inputs, targets[, positions]) and evaluate(...) alike: the
  // batch's parts as arguments (pybind's "incompatible function arguments"
  // and a dump of both arrays before).
  static py::dict batch_of(py::object inputs, py::object targets, py::object positions) {
    py::dict d;
    d["inputs"] = inputs;
    d["targets"] = targets;
    if (!positions.is_none()) d["positions"] = positions;
    return d;
  }
  float forward_parts(py::object inputs, py::object targets, py::object positions) {
    return forward(batch_of(inputs, targets, positions));
  }
  double evaluate_parts(py::object inputs, py::object targets, py::object positions) {
    return evaluate(batch_of(inputs, targets, positions));
  }
  // DeepSpeed's engine.backward(loss) takes the loss forward returned:
  // zinc's backward is always the last forward's, so a loss given must be
  // that one (another value was some other tensor's).
  void backward(py::object loss) {
    zinc::Engine& e = engine("backward");
    if (!loss.is_none()) {
      double v = 0;
      try {
        v = loss.cast<double>();
      } catch (const py::cast_error&) {
        throw py::type_error("zinc.Engine.backward: loss must be the float forward() returned (or nothing), got " +
                             std::string(py::str(py::type::of(loss).attr("__name__"))));
      }
      const double last = last_forward_;
      if (!(static_cast<float>(v) == static_cast<float>(last) || (std::isnan(v) && std::isnan(last))))
        throw py::value_error("zinc.Engine.backward: loss " + std::to_string(v) + " is not the last forward's (" +
                              std::to_string(last) + "); zinc's backward runs the last forward's loss: pass that "
                              "value or nothing");
    }
    ComputeScope scope;
    e.backward();
  }
  void step() {
    zinc::Engine& e = engine("step");
    ComputeScope scope;
    const int64_t before = e.global_steps();
    e.step();
    if (e.global_steps() > before) {  // the accumulation boundary: a step of the optimizer
      monitor_step(e, loss_n_ > 0 ? loss_sum_ / static_cast<double>(loss_n_) : NAN);
      loss_sum_ = 0;
      loss_n_ = 0;
    }
  }
  // One global batch: from the config's data (data None), or from an
  // iterable of gradient_accumulation_steps batches.
  double train_batch(py::object data) {
    zinc::Engine& e = engine("train_batch");
    if (data.is_none()) {
      check_config_batch("zinc.Engine.train_batch");
      ComputeScope scope;
      return monitor_step(e, e.train_batch(*loader_));
    }
    // Note [the batches train_batch reads]: an iterator (a generator,
    // iter(loader)) gives the next gradient_accumulation_steps batches
    // and keeps the rest, as DeepSpeed's train_batch(data_iter) reads; it
    // was read to its end (an endless one never returned, its memory
    // growing). A sequence (a list, a tuple) must hold exactly that many:
    // its first ones every call would train on them again and again.
    const int64_t ga = ex_.config.gradient_accumulation_steps;
    const std::string fn = "zinc.Engine.train_batch";
    const bool pair_of_arrays = (py::isinstance<py::tuple>(data) || py::isinstance<py::list>(data)) &&
                                py::len(data) == 2 && py::isinstance<py::array>(data[py::int_(0)]);
    if (pair_of_arrays)
      throw py::type_error(fn + ": data is an iterable of batches (gradient_accumulation_steps = " +
                           std::to_string(ga) + " of them), got one (inputs, targets) pair; pass [batch]");
    py::iterator it;
    try {
      it = py::iter(data);
    } catch (py::error_already_set& err) {
      if (!err.matches(PyExc_TypeError)) throw;
      throw py::type_error(fn + ": data must be an iterable of batches (an iterator, or a list of " +
                           std::to_string(ga) + "), got " + type_name(data));
    }
    if (!it.is(data) && py::hasattr(data, "__len__") && static_cast<int64_t>(py::len(data)) != ga)
      throw py::value_error(fn + ": data must hold gradient_accumulation_steps = " + std::to_string(ga) +
                            " batches, got " + std::to_string(py::len(data)) +
                            " (an iterator gives its next " + std::to_string(ga) + " and keeps the rest)");
    std::vector<zinc::Batch> batches;
    for (int64_t i = 0; i < ga; ++i) {
      PyObject* next = PyIter_Next(it.ptr());
      if (!next) {
        if (PyErr_Occurred()) throw py::error_already_set();
        throw py::value_error(fn + ": data ran out after " + std::to_string(i) +
                              " batches; a global batch is gradient_accumulation_steps = " + std::to_string(ga));
      }
      batches.push_back(to_batch(py::reinterpret_steal<py::object>(next), fn));
    }
    ComputeScope scope;
    return monitor_step(e, e.train_batch(batches));
  }
  double evaluate(py::object batch) {
    zinc::Engine& e = engine("evaluate");
    if (batch.is_none()) {
      if (!ex_.eval_data)
        throw py::value_error(
            "zinc.Engine.evaluate: the config has no held-out data (set run.eval_interval > 0), so pass a batch");
      check_config_batch("zinc.Engine.evaluate");
      ComputeScope scope;
      return zinc::tools::evaluate(e, *ex_.eval_data, ex_.experiment.run.eval_batches,
                                   ex_.config.train_micro_batch_size_per_gpu);
    }
    zinc::Batch b = to_batch(batch, "zinc.Engine.evaluate");
    ComputeScope scope;
    return e.evaluate(b);
  }

  // zinc-train's client state, so that either can resume the other's
  // checkpoints: the data loader's position and the step.
  void save_checkpoint(py::object dir_path, py::object tag_object, py::object client_state) {
    const std::string dir = path_text(dir_path, "save_checkpoint", "save_dir");
    zinc::Engine& e = engine("save_checkpoint");
    const std::optional<std::string> tag = tag_text(tag_object, "save_checkpoint");
    json client = client_state.is_none() ? json::object() : from_py(client_state, "client_state");
    if (!client.is_object()) throw py::type_error("zinc.Engine.save_checkpoint: client_state must be a dict");
    // JSON has no NaN or infinity: the file would hold null, and the load
    // hand back None where the caller saved a number.
    if (const std::string at = non_finite_at(client, "client_state"); !at.empty())
      throw py::value_error("zinc.Engine.save_checkpoint: " + at + " is not a finite number (NaN or infinity), which "
                            "a checkpoint's JSON cannot hold; store it as a string, or leave it out");
    // zinc's own keys (the data position, the step, ...) go beside the
    // caller's: a key of the caller's with one of their names and another
    // value would be replaced without a word (DeepSpeed's {"step": n} with
    // the engine's step is the same value, and kept).
    json own = json::object();
    zinc::tools::add_resume_state(own, ex_, *loader_, e.global_steps(),
                                  [this]() -> const std::string& { return base_fingerprint(); });
    for (auto it = own.begin(); it != own.end(); ++it)
      if (client.contains(it.key()) && client[it.key()] != it.value())
        throw py::value_error("zinc.Engine.save_checkpoint: client_state['" + it.key() + "'] is " +
                              client[it.key()].dump().substr(0, 60) + ", but '" + it.key() +
                              "' is zinc's own key there (it holds " + it.value().dump().substr(0, 60) +
                              "): give yours another name");
    client.update(own);
    // A tag the save refuses, refused before the folder is made and held
    // (an empty folder with its lock file was left behind).
    if (tag) zinc::ckpt::check_tag(*tag);
    ComputeScope scope;
    namespace fs = std::filesystem;
    std::error_code ec;
    const bool existed = fs::exists(fs::symlink_status(dir, ec));
    const std::string taken = hold_save_folder(dir);
    try {
      e.save_checkpoint(dir, tag.value_or(""), client);
    } catch (...) {
      // A save refused before it wrote (mid-batch, a tag in use) into a
      // folder this call made: the folder and its lock file go, and the
      // lock (a folder it made and holds, without a checkpoint in it).
      if (!taken.empty()) release_save_folder(taken, dir, existed);
      throw;
    }
  }
  // A folder argument: a str, bytes or os.PathLike (pathlib.Path), as
  // zinc.initialize takes its config's path; a NUL in it is refused later,
  // naming the call.
  static std::string path_text(py::handle h, const char* fn, const char* arg) {
    py::object p = py::reinterpret_steal<py::object>(PyOS_FSPath(h.ptr()));
    if (!p) {
      PyErr_Clear();
      throw py::type_error(std::string("zinc.Engine.") + fn + ": " + arg +
                           " must be a path (str or os.PathLike), got " + type_name(h));
    }
    if (py::isinstance<py::bytes>(p)) return p.cast<std::string>();
    Py_ssize_t n = 0;
    const char* text = PyUnicode_AsUTF8AndSize(p.ptr(), &n);
    if (!text) throw py::error_already_set();
    return std::string(text, static_cast<size_t>(n));
  }
  // Where `j` holds a NaN or an infinity (a JSON path under `at`), or "".
  static std::string non_finite_at(const json& j, const std::string& at) {
    if (j.is_number_float()) return std::isfinite(j.get<double>()) ? std::string() : at;
    if (j.is_object())
      for (auto it = j.begin(); it != j.end(); ++it)
        if (std::string w = non_finite_at(it.value(), at + "['" + it.key() + "']"); !w.empty()) return w;
    if (j.is_array())
      for (size_t i = 0; i < j.size(); ++i)
        if (std::string w = non_finite_at(j[i], at + "[" + std::to_string(i) + "]"); !w.empty()) return w;
    return std::string();
  }
  // Note [an engine holds the folders it saves into]: from its first save
  // into a folder until it is closed, as zinc-train holds its
  // run.checkpoint_dir: a zinc-train started on the folder meanwhile (the
  // engine between two saves) went on, and the engine's next save moved
  // `latest` back over that run's. Rank 0 takes the lock; every rank learns
  // whether it could. zinc.train's own folder is held already.
  // Returns the lock's key when this call took it, "" when it was held.
  std::string hold_save_folder(const std::string& dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    auto key_of = [&](const std::string& d) { return fs::weakly_canonical(fs::absolute(d, ec), ec).string(); };
    const std::string key = key_of(dir);
    if (save_locks_.count(key) || (folder_lock_ && key == key_of(ex_.experiment.run.checkpoint_dir))) return "";
    std::unique_ptr<zinc::ckpt::DirLock> lock;
    std::string error;
    if (!comm_ || comm_->rank() == 0) {
      try {
        lock = std::make_unique<zinc::ckpt::DirLock>(dir, "checkpoint folder", "", zinc::ckpt::LockUse::kRun);
      } catch (const zinc::Error& x) {
        error = x.what();
      }
    }
    double failed = error.empty() ? 0 : 1;
    if (comm_ && comm_->size() > 1) comm_->all_reduce_max_f64(&failed, 1);
    if (!error.empty()) throw zinc::IoError("zinc.Engine.save_checkpoint: " + error);
    if (failed > 0)
      throw zinc::IoError("zinc.Engine.save_checkpoint: rank 0 could not take the checkpoint folder " + dir +
                          " (its error is on its output)");
    save_locks_[key] = std::move(lock);  // null on the other ranks
    return key;
  }
  // After a first save into `dir` failed: its lock is let go; a folder the
  // save made (it did not exist) that holds nothing but the lock file is
  // removed, the file unlinked while still held (see DirLock).
  void release_save_folder(const std::string& key, const std::string& dir, bool existed) {
    namespace fs = std::filesystem;
    auto it = save_locks_.find(key);
    if (it == save_locks_.end()) return;
    std::error_code ec;
    const fs::path lock_file = fs::path(dir) / ".zinc.lock";
    const bool only_lock = it->second && !existed && fs::is_regular_file(fs::symlink_status(lock_file, ec)) &&
                           std::distance(fs::directory_iterator(dir, ec), fs::directory_iterator()) == 1;
    if (only_lock) ::unlink(lock_file.c_str());
    save_locks_.erase(it);
    if (only_lock) ::rmdir(dir.c_str());
  }
  py::object save_pretrained(py::object dir_path, std::optional<std::string> dtype, const std::string& max_shard,
                             bool merge) {
    const std::string dir = path_text(dir_path, "save_pretrained", "save_dir");
    zinc::Engine& e = engine("save_pretrained");
    if (!ex_.hf)
      throw zinc::Error("zinc.Engine.save_pretrained: model \"" + ex_.model->name() +
                        "\" has no Hugging Face architecture (the gpt and the llama have)");
    zinc::tools::HfExportOptions o;
    o.out_dir = dir;
    if (dtype) {
      if (*dtype == "fp32" || *dtype == "float32") o.dtype = zinc::DType::kF32;
      else if (*dtype == "bf16" || *dtype == "bfloat16") o.dtype = zinc::DType::kBF16;
      else if (*dtype == "fp16" || *dtype == "float16") o.dtype = zinc::DType::kF16;
      else throw py::value_error("zinc.Engine.save_pretrained: dtype must be fp32, bf16 or fp16, got '" + *dtype + "'");
    }
    try {
      o.max_shard_bytes = zinc::tools::parse_size(max_shard, "max_shard_size");
    } catch (const zinc::Error& err) {
      throw py::value_error(std::string("zinc.Engine.save_pretrained: ") + err.what());
    }
    o.copy_from = ex_.experiment.model.from_pretrained;
    o.rank = comm_ ? comm_->rank() : 0;
    o.inputs = zinc::tools::run_inputs(ex_, "");
    o.what = "zinc.Engine.save_pretrained";
    o.merge_adapters = merge;
    zinc::tools::HfExportResult r;
    {
      ComputeScope scope;
      r = zinc::tools::export_hf(*ex_.hf, e.model(),
                                 zinc::tools::export_reader(e.model(), [&](int b) { return e.full_params(b); }), o);
    }
    py::dict out;
    out["files"] = r.files;
    out["index"] = r.index;
    out["copied"] = r.copied;
    out["tensors"] = r.tensors;
    out["bytes"] = r.bytes;
    out["dtype"] = std::string(zinc::dtype_name(r.dtype));
    return out;
  }
  py::object save_adapter(py::object dir_path) {
    const std::string dir = path_text(dir_path, "save_adapter", "save_dir");
    zinc::Engine& e = engine("save_adapter");
    if (!ex_.hf) throw zinc::Error("zinc.Engine.save_adapter: model \"" + ex_.model->name() + "\" has no LoRA adapters");
    zinc::tools::PeftExportOptions o;
    o.out_dir = dir;
    o.rank = comm_ ? comm_->rank() : 0;
    o.inputs = zinc::tools::run_inputs(ex_, "");
    o.what = "zinc.Engine.save_adapter";
    o.base_model = ex_.experiment.model.from_pretrained;
    zinc::tools::PeftExportResult r;
    {
      ComputeScope scope;
      r = zinc::tools::export_peft_adapter(*ex_.hf, e.model(), [&](int b) { return e.full_params(b); }, o);
    }
    py::dict out;
    out["file"] = r.file;
    out["tensors"] = r.tensors;
    out["bytes"] = r.bytes;
    return out;
  }
  py::object load_checkpoint(py::object dir_path, py::object tag_object) {
    const std::string dir = path_text(dir_path, "load_checkpoint", "load_dir");
    zinc::Engine& e = engine("load_checkpoint");
    const std::optional<std::string> tag = tag_text(tag_object, "load_checkpoint");
    json client;
    {
      ComputeScope scope;
      // zinc-train --resume's checks, before anything is read: the adapters
      // and the data position (it raised after the load had replaced the
      // engine's state, and a LoRA scale change loaded without a word).
      zinc::tools::check_resume(ex_, dir, tag.value_or(""), *loader_,
                                [this]() -> const std::string& { return base_fingerprint(); },
                                /*position_required=*/false);
      client = e.load_checkpoint(dir, tag.value_or(""));
    }
    if (client.is_object() && client.contains("samples") && client["samples"].is_number_integer())
      loader_->set_position(client["samples"].get<int64_t>());
    // The curves past the loaded step (a crashed run's) go, as at a resume.
    if (monitors_) monitors_->resumed(e.global_steps() * ex_.config.train_batch_size);
    loss_sum_ = 0;
    loss_n_ = 0;
    return to_py(client);
  }

  // A checkpoint tag as DeepSpeed takes it: a str, or an int (str(tag):
  // DeepSpeed users pass the step); None for the default.
  static std::optional<std::string> tag_text(py::handle tag, const char* fn) {
    if (tag.is_none()) return std::nullopt;
    if (py::isinstance<py::str>(tag)) {
      // The engine reads "" as no tag: a save named it global_stepN, a load
      // read `latest`, where the caller named a tag.
      std::string text = tag.cast<std::string>();
      if (text.empty())
        throw py::value_error(std::string("zinc.Engine.") + fn + ": tag is empty; leave it None for " +
                              (std::strcmp(fn, "save_checkpoint") == 0 ? "global_step<N>" : "the tag `latest` names"));
      return text;
    }
    if (py::isinstance<py::int_>(tag) && !py::isinstance<py::bool_>(tag)) return std::string(py::str(tag));
    throw py::type_error(std::string("zinc.Engine.") + fn + ": tag must be a str or an int, got " +
                         std::string(py::str(py::type::of(tag).attr("__name__"))));
  }

  // hf_weights_fingerprint of model.from_pretrained where LoRA leaves it
  // frozen (empty otherwise), once.
  const std::string& base_fingerprint() {
    if (!base_fingerprint_) {
      const std::string& base = ex_.experiment.model.from_pretrained;
      base_fingerprint_ = ex_.hf && ex_.hf->model->lora().enabled() && !base.empty()
                              ? zinc::tools::hf_weights_fingerprint(base)
                              : std::string();
    }
    return *base_fingerprint_;
  }
  py::object config() const { return to_py(zinc::tools::config_event(ex_, world())["config"]); }
  int world() const { return comm_ ? comm_->size() : 1; }
  const zinc::tools::Experiment& experiment() const { return ex_; }
  zinc::DataLoader& loader() { return *loader_; }
  zinc::comm::Communicator* communicator() const { return comm_.get(); }

 private:
  // A batch larger than any so far: MemoryError where its activations
  // cannot fit (tools::batch_room_refusal), before anything is allocated.
  // A batch no larger in B and in T than one let through needs no more
  // (a product no larger does not: attention's scores grow with T^2).
  void check_room(int64_t B, int64_t T, const std::string& fn) {
    if (B <= held_B_ && T <= held_T_) return;
    const int64_t b = std::max(B, held_B_), t = std::max(T, held_T_);
    const std::string why =
        zinc::tools::batch_room_refusal(*ex_.model, ex_.config.compute_dtype(), b, t, held_B_, held_T_);
    if (!why.empty()) {
      PyErr_SetString(PyExc_MemoryError, (fn + ": " + why).c_str());
      throw py::error_already_set();
    }
    held_B_ = b;
    held_T_ = t;
  }
  // The config's micro-batch (the data section's batches, the held-out ones).
  void check_config_batch(const std::string& fn) {
    check_room(ex_.config.train_micro_batch_size_per_gpu, ex_.data->seq_len(), fn);
  }
  int64_t held_B_ = 0, held_T_ = 0;  // the largest batch check_room let through

  // A batch: (inputs, targets) as a tuple or list, or a dict with those keys
  // and optionally 'positions' (packed documents, Batch::positions).
  zinc::Batch to_batch(py::handle batch, const std::string& fn) {
    py::object in, tg, pos;
    if (py::isinstance<py::dict>(batch)) {
      py::dict d = py::reinterpret_borrow<py::dict>(batch);
      if (!d.contains("inputs") || !d.contains("targets"))
        throw py::value_error(fn + ": batch must have the keys 'inputs' and 'targets'");
      // A key zinc does not read would be dropped without a word: an
      // attention_mask that the user meant to mask padding, a misspelt
      // 'positons' that would leave documents unseparated.
      for (const auto& kv : d) {
        const std::string key = py::str(kv.first);
        if (key != "inputs" && key != "targets" && key != "positions")
          throw py::value_error(fn + ": batch has the key '" + key + "', which zinc does not read (its keys: 'inputs', "
                                "'targets' and optionally 'positions'; mask a target with -100, and separate packed "
                                "documents with 'positions')");
      }
      in = d["inputs"];
      tg = d["targets"];
      if (d.contains("positions") && !d["positions"].is_none()) pos = d["positions"];
    } else if ((py::isinstance<py::tuple>(batch) || py::isinstance<py::list>(batch)) && py::len(batch) == 2) {
      in = batch[py::int_(0)];
      tg = batch[py::int_(1)];
    } else {
      throw py::type_error(fn + ": batch must be an (inputs, targets) pair or a dict of them, got " +
                           type_name(batch));
    }
    py::array_t<int32_t> a = token_array(in, fn, "inputs");
    py::array_t<int32_t> t = token_array(tg, fn, "targets");
    if (a.shape(0) != t.shape(0) || a.shape(1) != t.shape(1))
      throw py::value_error(fn + ": targets must have the shape of inputs (" + std::to_string(a.shape(0)) + ", " +
                            std::to_string(a.shape(1)) + "), got (" + std::to_string(t.shape(0)) + ", " +
                            std::to_string(t.shape(1)) + ")");
    zinc::Batch b;
    b.B = a.shape(0);
    b.T = a.shape(1);
    if (max_t_ > 0 && b.T > max_t_)
      throw py::value_error(fn + ": inputs has T = " + std::to_string(b.T) + " tokens per sample; the model's block_size is " +
                            std::to_string(max_t_));
    // Before the copies: a batch too large for memory (a np.memmap of
    // gigabytes) is refused before it is copied too.
    check_room(b.B, b.T, fn);
    const size_t n = static_cast<size_t>(b.B * b.T);
    b.inputs.assign(a.data(), a.data() + n);
    b.targets.assign(t.data(), t.data() + n);
    if (pos) {
      py::array_t<int32_t> p = token_array(pos, fn, "positions");
      if (p.shape(0) != a.shape(0) || p.shape(1) != a.shape(1))
        throw py::value_error(fn + ": positions must have the shape of inputs (" + std::to_string(a.shape(0)) + ", " +
                              std::to_string(a.shape(1)) + ")");
      b.positions.assign(p.data(), p.data() + n);
      // The engine's rule (Engine::Impl::check_batch), said here as the
      // ValueError of a bad argument, with the call's name.
      for (int64_t r = 0; r < b.B; ++r)
        for (int64_t j = 0; j < b.T; ++j) {
          const int32_t v = b.positions[static_cast<size_t>(r * b.T + j)];
          const int32_t prev = j > 0 ? b.positions[static_cast<size_t>(r * b.T + j - 1)] : -1;
          if (v != 0 && v != prev + 1)
            throw py::value_error(fn + ": positions[" + std::to_string(r) + ", " + std::to_string(j) + "] = " +
                                  std::to_string(v) + "; each row starts at 0 and each next position is 0 (a new "
                                  "document) or the previous + 1");
        }
    }
    check_tokens(b.inputs, b.T, fn, "inputs");
    check_tokens(b.targets, b.T, fn, "targets", true);
    return b;
  }
  // Targets may also be -100 (zinc::kIgnoreTarget): no target there.
  void check_tokens(const std::vector<int32_t>& v, int64_t T, const std::string& fn, const char* name,
                    bool targets = false) const {
    for (size_t i = 0; i < v.size(); ++i)
      if ((v[i] < 0 || v[i] >= vocab_) && !(targets && v[i] == zinc::kIgnoreTarget))
        throw py::value_error(fn + ": " + name + "[" + std::to_string(static_cast<int64_t>(i) / T) + ", " +
                              std::to_string(static_cast<int64_t>(i) % T) + "] = " + std::to_string(v[i]) +
                              " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
  }

  // The end of a Call: a close() that came during it frees the engine now,
  // before the next call may start.
  void end_call() {
    std::unique_lock<std::mutex> lock(call_mu_);
    if (close_pending_) {
      lock.unlock();
      free_engine();
      lock.lock();
      close_pending_ = false;
    }
    in_call_.clear();
    call_thread_ = {};
  }
  // Note [monitors of a driven engine]
  // (And every steps_per_print steps a log line, as DeepSpeed's engine
  // logs.) An engine driven by train_batch, or by forward, backward and step,
  // writes the config's tensorboard and csv_monitor curves as DeepSpeed's
  // engine does (it wrote nothing, without a word): at each optimizer step,
  // x the samples trained (global_steps x train_batch_size), the loss (the
  // global batch's mean from train_batch; this rank's forwards' mean since
  // the last step otherwise, as DeepSpeed's), the learning rate, with fp16
  // the loss scale, and the gradient norm (Note [monitor scalars] in
  // tools/run_loop.cpp). Rank 0 writes; a monitor whose file fails is
  // dropped with a warning; load_checkpoint drops the curves past the
  // loaded step.
  float note_loss(float loss) {
    last_forward_ = loss;
    loss_sum_ += loss;
    ++loss_n_;
    return loss;
  }
  double monitor_step(zinc::Engine& e, double loss) {
    // DeepSpeed's engine logs every steps_per_print steps (with
    // wall_clock_breakdown its timers): so does this one, on rank 0, as a
    // log line (ZINC_LOG_LEVEL=warn quiets it).
    const zinc::Config& cfg = ex_.config;
    if (e.global_steps() % cfg.steps_per_print == 0 && (!comm_ || comm_->rank() == 0)) {
      char line[256];
      std::snprintf(line, sizeof line, "step %lld | loss %.4f | lr %.3e | grad norm %.3f",
                    static_cast<long long>(e.global_steps()), loss, e.learning_rate(), e.global_grad_norm());
      std::string text = line;
      if (cfg.wall_clock_breakdown) {
        const zinc::StepTimings t = e.timings();
        std::snprintf(line, sizeof line, " | time so far: forward %.2fs | backward %.2fs | optimizer step %.2fs",
                      t.forward_s, t.backward_s, t.step_s);
        text += line;
      }
      zinc::log_info(text);
    }
    if (!monitors_) return loss;
    const int64_t samples = e.global_steps() * ex_.config.train_batch_size;
    if (!std::isnan(loss)) monitors_->write("Train/Samples/train_loss", loss, samples);
    monitors_->write("Train/Samples/lr", e.learning_rate(), samples);
    if (ex_.config.fp16.enabled) monitors_->write("Train/Samples/loss_scale", e.loss_scale(), samples);
    monitors_->write("Train/Samples/grad_norm", e.global_grad_norm(), samples);
    monitors_->flush();
    return loss;
  }

  void free_engine() {
    if (forked()) {  // Note [engines across fork]: the parent's; left as it is
      new zinc::Engine(std::move(*engine_));
      engine_.reset();
      (void)monitors_.release();  // its files are the parent's: not flushed again
      (void)loader_.release();
      (void)folder_lock_.release();
      for (auto& [dir, lock] : save_locks_) (void)lock.release();
      new std::shared_ptr<zinc::comm::Communicator>(std::move(comm_));
      return;
    }
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check()) release.emplace();
    engine_.reset();
    loader_.reset();
    monitors_.reset();
    save_locks_.clear();
  }

  json doc_;
  std::shared_ptr<zinc::comm::Communicator> comm_;
  std::unique_ptr<zinc::ckpt::DirLock> folder_lock_;  // zinc.train's checkpoint folder
  // Note [an engine holds the folders it saves into]: by resolved path.
  std::map<std::string, std::unique_ptr<zinc::ckpt::DirLock>> save_locks_;
  std::optional<std::string> base_fingerprint_;       // of model.from_pretrained, for check_resume
  zinc::tools::Experiment ex_;
  std::optional<zinc::Engine> engine_;
  std::unique_ptr<zinc::DataLoader> loader_;
  std::unique_ptr<zinc::tools::Monitors> monitors_;  // Note [monitors of a driven engine]
  double loss_sum_ = 0;                             // this rank's forward losses since the last step
  double last_forward_ = NAN;                       // the last forward's loss (backward(loss) checks it)
  int64_t loss_n_ = 0;
  int64_t vocab_ = 0, max_t_ = 0;
  pid_t owner_pid_ = ::getpid();  // the process that made the engine
  // Note [one call at a time]. call_mu_ guards the three below, only ever
  // for a few instructions (never across a computation, so never waited on
  // for long; try-locking is not needed).
  mutable std::mutex call_mu_;
  std::string in_call_;  // the name of the call in flight; empty: none
  std::thread::id call_thread_;
  bool close_pending_ = false;
};

// A binding of a PyEngine method that holds the engine's Call around it
// (Note [one call at a time]).
//
// Note [an allocation that failed mid-call]
// An allocation that fails inside a call (past the batch's room check:
// the estimate is an estimate) leaves the engine mid-step, holding what it
// had allocated so far; a later call then ran out again where oneDNN does
// not fail cleanly (a segfault creating a primitive), and so did a new
// engine beside it. So the engine is closed there (freed when the call
// ends) and the MemoryError says so: a new engine with a smaller batch is
// the way on.
[[noreturn]] void out_of_memory(const std::string& fn, const std::bad_alloc& x) {
  PyErr_SetString(PyExc_MemoryError, (fn + ": out of memory: an allocation failed (" + x.what() +
                                      ") building the engine; zinc-train CONFIG --estimate says what a config needs")
                                         .c_str());
  throw py::error_already_set();
}

template <class R, class... A>
auto one_call(const char* name, R (PyEngine::*f)(A...)) {
  return [name, f](PyEngine& e, A... a) -> R {
    const std::string fn = std::string("zinc.Engine.") + name;
    PyEngine::Call call(e, fn);
    try {
      return (e.*f)(std::forward<A>(a)...);
    } catch (const std::bad_alloc& x) {
      e.close();  // pending: freed as the Call ends
      PyErr_SetString(PyExc_MemoryError,
                      (fn + ": out of memory: an allocation failed (" + x.what() +
                       "); the engine is closed, its memory freed (it was left mid-step): make a new one with "
                       "smaller batches or less memory per rank (zinc-train CONFIG --estimate says what a "
                       "config needs)")
                          .c_str());
      throw py::error_already_set();
    }
  };
}
// A property reading the engine under a Call.
template <class R>
auto engine_property(const char* name, R (zinc::Engine::*getter)() const) {
  return [name, getter](PyEngine& e) { return e.read(name, [getter](zinc::Engine& x) { return (x.*getter)(); }); };
}

// ---- zinc.train ----------------------------------------------------------

// One config-only run, step by step: tools/run_loop.h's loop (zinc-train's),
// its events returned as dicts for zinc.train's generator. Every rank returns
// the same events (zinc-train prints rank 0's).
//
// Note [zinc.train's stop]
// A Ctrl-C (or SIGTERM) is raised between steps, as KeyboardInterrupt (or
// Python's SIGTERM action). A run that saves (run.checkpoint_interval > 0)
// first saves the step it stopped at, as zinc-train does on a signal: it
// lost the steps since its last save. The loop's stop hook runs at each
// step boundary, inside the ComputeScope, where the signals are blocked:
// - a SIGINT (or a SIGTERM Python handles) pending there is taken
//   (sigtimedwait) and handed to Python's handler at once
//   (PyErr_SetInterruptEx, then PyErr_CheckSignals with the GIL taken): a
//   handler that raises stops the run, and its exception is kept and raised
//   at the next step() call, after this step's events (the signal, let
//   through when the scope ended, raised before the generator yielded
//   them); a handler that raises nothing lets the run go on;
// - one another Python thread took has run Python's handler already: its
//   flag is seen the same way;
// - a SIGTERM Python leaves to its default action stops the run here, and,
//   still pending, ends the interpreter once the saved step returns;
// - one that came between steps (seen as step() begins) is kept likewise,
//   and that step is trained and saved, as zinc-train finishes the step
//   under way.
// Every rank stops at the same boundary (the loop's agreement; a stop
// decided outside it would leave the ranks' collectives unmatched).
class TrainRun {
 public:
  TrainRun(py::handle config, std::optional<int64_t> steps, bool ignore_resources)
      : engine_(config, steps, "zinc.train", ignore_resources) {
    PyEngine::Call call(engine_, "zinc.train");
    zinc::tools::RunLoop::Hooks hooks;
    saves_ = engine_.experiment().experiment.run.checkpoint_interval > 0;
    if (saves_) hooks.stop_requested = [this] { return stop_signal(); };
    loop_ = std::make_unique<zinc::tools::RunLoop>(engine_.engine("train"), engine_.loader(), engine_.experiment(),
                                                   engine_.communicator(), std::move(hooks));
    g_runs.insert(this);
  }
  ~TrainRun() {
    g_runs.erase(this);
    if (engine_.forked()) (void)loop_.release();  // Note [engines across fork]: its monitors' files are the parent's
  }
  PyEngine& engine() { return engine_; }

  py::list start() { return to_list(loop_->start()); }

  // The events of the next step, or None after the last one.
  py::object step() {
    raise_interrupt();  // Note [zinc.train's stop]: the saved step's events came first
    // One that came between steps: this step is the one saved.
    if (saves_) {
      if (PyErr_CheckSignals() != 0) interrupt_.emplace();
    } else {
      check_signals();
    }
    PyEngine::Call call(engine_, "zinc.train");  // the whole step, its checkpoint included
    engine_.engine("train");                     // raises once the engine is closed
    const std::optional<std::vector<json>> evs = [&] {
      ComputeScope scope;
      return loop_->step();
    }();
    if (!evs) raise_interrupt();
    return evs ? py::object(to_list(*evs)) : py::none();
  }
  void raise_interrupt() {
    if (!interrupt_) return;
    py::error_already_set e = std::move(*interrupt_);
    interrupt_.reset();
    throw e;
  }

  // The loop's stop hook (Note [zinc.train's stop]): inside a ComputeScope.
  int stop_signal() {
    if (interrupt_) return interrupt_signal_;
    sigset_t pending;
    if (sigpending(&pending) != 0) sigemptyset(&pending);
    // A SIGTERM that Python leaves to its default action (no handler of its
    // own): this step is saved, and the signal, left pending, ends the
    // interpreter once the step returns.
    if (sigismember(&pending, SIGTERM) == 1 && PyOS_getsig(SIGTERM) == SIG_DFL) return SIGTERM;
    py::gil_scoped_acquire gil;
    int taken = 0;
    // A pending one is taken here and handed to Python's handler now
    // (PyErr_SetInterruptEx): its handler decides (one that does not raise
    // lets the run go on), and the exception it raises is kept for the
    // next step() call, after this step's events (the unblocked signal
    // raised it before the generator could yield them).
    for (int sig : {SIGINT, SIGTERM}) {
      if (sigismember(&pending, sig) != 1) continue;
      sigset_t one;
      sigemptyset(&one);
      sigaddset(&one, sig);
      const timespec now{0, 0};
      if (sigtimedwait(&one, nullptr, &now) == sig && PyErr_SetInterruptEx(sig) == 0) taken = sig;
    }
    if (PyErr_CheckSignals() == 0) return 0;
    interrupt_.emplace();  // takes the Python exception the handler raised
    interrupt_signal_ = taken != 0 ? taken : SIGINT;
    return interrupt_signal_;
  }

  // The loop's summary: what zinc-train's says that does not need the whole
  // process's accounting (peak RSS per rank, communication shares, NVMe
  // traffic).
  py::dict summary() {
    PyEngine::Call call(engine_, "zinc.train");
    engine_.engine("train");
    return to_py(loop_->summary());
  }

 private:
  static py::list to_list(const std::vector<json>& evs) {
    py::list l;
    for (const json& ev : evs) l.append(to_py(ev));
    return l;
  }

  PyEngine engine_;
  std::unique_ptr<zinc::tools::RunLoop> loop_;
  bool saves_ = false;                               // run.checkpoint_interval > 0
  std::optional<py::error_already_set> interrupt_;  // Note [zinc.train's stop]
  int interrupt_signal_ = SIGINT;                   // ... and the signal that raised it, for stopped_by  // refers to engine_'s engine: used only while it is open
};

}  // namespace

PYBIND11_MODULE(_zinc, m) {
  m.doc() = "zinc's C++ engine (use the package `zinc`, which re-exports it).";
  m.attr("__version__") = ZINC_VERSION;

  g_error = PyErr_NewExceptionWithDoc("zinc.Error", "An error from zinc's engine (the base of CommError).",
                                      PyExc_RuntimeError, nullptr);
  g_config_error = PyErr_NewExceptionWithDoc(
      "zinc.ConfigError",
      "A config value that is wrong. A ValueError; .path is the JSON path of the value (\"\" when the error "
      "is not about one value), and the message starts with it.",
      PyExc_ValueError, nullptr);
  g_comm_error = PyErr_NewExceptionWithDoc("zinc.CommError", "A collective between ranks that failed.", g_error, nullptr);
  m.attr("Error") = py::handle(g_error);
  m.attr("ConfigError") = py::handle(g_config_error);
  m.attr("CommError") = py::handle(g_comm_error);
  py::register_exception_translator(&translate);

  py::class_<PyEngine>(m, "Engine", zinc::python::refuse_unconstructed(), R"doc(
A training engine over one of zinc's built-in models: ZeRO stages 0-3,
bf16 / fp16, gradient accumulation, offload, as the config says. Make one
with zinc.initialize(config).

Batches: None takes the next micro-batch from the config's data section (the
order zinc-train uses); otherwise (inputs, targets), or a dict with those
keys, where both are C-contiguous numpy int32 arrays of shape (B, T) with
token ids below the model's vocabulary. Under mpirun every rank makes the
same calls in the same order, each with its own part of the global batch.

Every call that computes releases the GIL. A Ctrl-C arriving during a call
is raised as KeyboardInterrupt when the call returns, so the engine is
always left between calls and stays usable. close() (or a with block)
frees the engine; any call after it raises ValueError.

One call at a time: a call made while another is running on the same
engine (from another thread, or from inside it) raises RuntimeError at
once instead of waiting. close() during a running call from another thread
marks the engine closed and returns; the running call finishes and frees it.
)doc")
      .def("forward", one_call("forward", &PyEngine::forward), py::arg("batch") = py::none(),
           "forward(batch=None) -> float\n\nOne micro-batch forward; returns its mean loss.")
      .def("forward", one_call("forward", &PyEngine::forward_parts), py::arg("inputs"), py::arg("targets"),
           py::arg("positions") = py::none(),
           "forward(inputs, targets, positions=None) -> float\n\nThe same, the batch's parts as arguments.")
      .def("backward", one_call("backward", &PyEngine::backward), py::arg("loss") = py::none(),
           "backward(loss=None)\n\nBackward of the last forward; gradients accumulate. loss, as DeepSpeed's "
           "engine.backward(loss) takes it: the value that forward returned (checked), or nothing.")
      .def("step", one_call("step", &PyEngine::step),
           "step()\n\nAt a gradient-accumulation boundary: global norm, clipping, the optimizer step and the "
           "schedule's advance; elsewhere nothing (as DeepSpeed's engine.step()).")
      .def("train_batch", one_call("train_batch", &PyEngine::train_batch), py::arg("data") = py::none(),
           "train_batch(data=None) -> float\n\nOne global batch (gradient_accumulation_steps x forward, backward, "
           "step); returns its mean loss over all micro-batches and ranks. data: None for the config's data, or "
           "an iterator, of which it takes the next gradient_accumulation_steps batches (as DeepSpeed's "
           "train_batch(data_iter)), or a list of exactly that many.")
      .def("evaluate", one_call("evaluate", &PyEngine::evaluate), py::arg("batch") = py::none(),
           "evaluate(batch=None) -> float\n\nForward only. None: the mean loss over run.eval_batches held-out "
           "micro-batches, as zinc-train's eval events report it (needs run.eval_interval > 0); a batch: its "
           "mean loss over its targets. NaN when there is no target (every one -100): no loss, never 0.")
      .def("evaluate", one_call("evaluate", &PyEngine::evaluate_parts), py::arg("inputs"), py::arg("targets"),
           py::arg("positions") = py::none(),
           "evaluate(inputs, targets, positions=None) -> float\n\nThe same, the batch's parts as arguments.")
      .def("save_checkpoint", one_call("save_checkpoint", &PyEngine::save_checkpoint), py::arg("save_dir"),
           py::arg("tag") = py::none(), py::arg("client_state") = py::none(),
           "save_checkpoint(save_dir, tag=None, client_state=None)\n\nWrites save_dir/tag (None: "
           "'global_step<N>') and points save_dir/latest at it once complete. client_state (a JSON-able dict) is "
           "kept with it, together with the data position, so zinc-train --resume can continue it. Collective "
           "under mpirun. OSError when a file cannot be written.")
      .def("save_adapter", one_call("save_adapter", &PyEngine::save_adapter), py::arg("save_dir"),
           "save_adapter(save_dir) -> dict\n\nWrites the model's LoRA adapters (model.lora, model.adapter) as a "
           "PEFT adapter folder (adapter_config.json, adapter_model.safetensors) that peft.PeftModel.from_pretrained "
           "reads onto the base model. Collective under mpirun (rank 0 writes).")
      .def("save_pretrained", one_call("save_pretrained", &PyEngine::save_pretrained), py::arg("save_dir"),
           py::arg("dtype") = py::none(), py::arg("max_shard_size") = zinc::tools::kDefaultMaxShardSize,
           py::arg("merge") = false,
           "save_pretrained(save_dir, dtype=None, max_shard_size='5GB', merge=False) -> dict\n\nWrites the model in the "
           "Hugging Face layout transformers' from_pretrained reads: config.json, the weights under transformers' "
           "names (sharded with an index above max_shard_size) in dtype ('fp32', 'bf16', 'fp16'; None: the "
           "source folder's torch_dtype, else bf16), and model.from_pretrained's tokenizer files; a model with "
           "LoRA adapters needs merge=True (the adapters merged into the weights, PEFT's merge_and_unload). "
           "Collective under mpirun (rank 0 writes). Returns what was written.")
      .def("load_checkpoint", one_call("load_checkpoint", &PyEngine::load_checkpoint), py::arg("load_dir"),
           py::arg("tag") = py::none(),
           "load_checkpoint(load_dir, tag=None) -> dict\n\nLoads load_dir/tag (None: the tag load_dir/latest "
           "names), saved at any world size and ZeRO stage, restores the step counters, the schedule and the "
           "data position; returns the client_state. OSError naming the file for a missing or corrupt one.")
      .def("close", &PyEngine::close,
           "close()\n\nFrees the engine's memory and files. Idempotent; never raises. While another thread is "
           "inside a call on this engine, marks it closed and returns at once: that call finishes, then frees it.")
      .def("__enter__",
           [](py::handle self) {
             zinc::python::constructed_self<PyEngine>(self);
             return py::reinterpret_borrow<py::object>(self);
           })
      .def("__exit__", [](py::handle self, py::args) { zinc::python::constructed_self<PyEngine>(self).close(); })
      .def_property_readonly("closed", &PyEngine::closed, "True after close().")
      .def_property_readonly("global_steps", engine_property("global_steps", &zinc::Engine::global_steps),
                             "Optimizer steps taken (global batches completed), skipped ones included.")
      .def_property_readonly("skipped_steps", engine_property("skipped_steps", &zinc::Engine::skipped_steps),
                             "Steps skipped for non-finite gradients (fp16 overflow).")
      .def_property_readonly("micro_steps", engine_property("micro_steps", &zinc::Engine::micro_steps),
                             "Micro-batches run through backward.")
      .def_property_readonly("learning_rate", engine_property("learning_rate", &zinc::Engine::learning_rate),
                             "Learning rate of the most recent optimizer step (before the first: the first's).")
      .def_property_readonly("grad_norm", engine_property("grad_norm", &zinc::Engine::global_grad_norm),
                             "Global L2 norm of the averaged gradient at the last step, before clipping.")
      .def_property_readonly("last_loss", engine_property("last_loss", &zinc::Engine::last_batch_loss),
                             "Mean loss of the last completed global batch, over its micro-batches and all ranks.")
      .def_property_readonly("loss_scale", engine_property("loss_scale", &zinc::Engine::loss_scale),
                             "fp16: the loss scale of the next backward; 1.0 without fp16.")
      .def_property_readonly("rank", engine_property("rank", &zinc::Engine::rank), "This process's rank.")
      .def_property_readonly("world_size", engine_property("world_size", &zinc::Engine::world_size),
                             "Data-parallel ranks (1 outside mpirun).")
      .def_property_readonly("num_parameters", engine_property("num_parameters", &zinc::Engine::num_parameters),
                             "Parameters of the model (unpadded).")
      .def_property_readonly("config", &PyEngine::config,
                             "The resolved config: every key with the value it takes (zinc-train's config event).");

  m.def(
      "initialize",
      [](py::object config) {
        try {
          return std::make_unique<PyEngine>(config);
        } catch (const std::bad_alloc& x) {
          out_of_memory("zinc.initialize", x);
        }
      },
      py::arg("config"),
        R"doc(initialize(config) -> Engine

Builds the experiment a config describes, as zinc-train does: config is a
dict or a path (str or os.PathLike) to a JSON file, a DeepSpeed config plus
zinc's `model`, `data`, `run` and `comm` sections. Raises zinc.ConfigError
(a ValueError, with .path) for a wrong value and OSError for a file that
cannot be read. Under mpirun the ranks form the data-parallel world.)doc");

  py::class_<TrainRun>(m, "_TrainRun", zinc::python::refuse_unconstructed(),
                       "One zinc.train run, step by step (use zinc.train).")
      .def(py::init([](py::object config, std::optional<int64_t> steps, bool ignore_resources) {
             try {
               return std::make_unique<TrainRun>(config, steps, ignore_resources);
             } catch (const std::bad_alloc& x) {
               out_of_memory("zinc.train", x);
             }
           }),
           py::arg("config"), py::arg("steps") = py::none(), py::arg("ignore_resources") = false)
      .def("start", &TrainRun::start, "The config (and auto) events.")
      .def("step", &TrainRun::step, "Trains one step; its events, or None after the last step.")
      .def("summary", &TrainRun::summary, "The summary event.")
      .def_property_readonly("engine", &TrainRun::engine, py::return_value_policy::reference_internal);

  m.def("_shutdown", [] {
    g_shutting_down = true;
    for (TrainRun* r : std::set<TrainRun*>(g_runs)) r->engine().close();
    for (PyEngine* e : std::set<PyEngine*>(g_engines)) e->close();
    // A call still in flight (a daemon thread's: the main thread returned
    // while it trained) frees its engine as it returns. The process's exit
    // must not run the static destructors under it (the heap was seen
    // corrupted), so wait for it here, before finalisation, with the GIL
    // let go for it (it takes the GIL back on its way out). The engines are
    // looked at with the GIL held: a destructor (with the GIL) removes one.
    const auto busy = [] {
      for (PyEngine* e : g_engines)
        if (e->busy()) return true;
      for (TrainRun* r : g_runs)
        if (r->engine().busy()) return true;
      return false;
    };
    for (int waited_ms = 0; busy(); ++waited_ms) {
      if (waited_ms == 5000) zinc::log_info("exit: waiting for an engine call of another thread to end");
      py::gil_scoped_release release;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    py::gil_scoped_release release;
    g_comm.reset();
  }, "Closes every engine and lets MPI finalise (registered with atexit).");

  bind_optim(m);
  bind_bench(m);
}
