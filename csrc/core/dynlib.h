// zinc core: a shared library opened at run time (dlopen), for the optional
// GPU libraries (NCCL, cuBLAS). Linking them would make every zinc binary
// and the Python module load them at start, on machines without a GPU too,
// and a process that also loads PyTorch would then get zinc's NCCL in place
// of PyTorch's (the same soname, libnccl.so.2, loaded once per process). So
// they are opened on first use, RTLD_LOCAL, and only by the GPU paths.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace zinc {

class DynLib {
 public:
  // Opens the first of `candidates` (file names searched as dlopen does, or
  // paths) that loads. Throws zinc::Error naming `what`, every candidate
  // tried and the loader's last message.
  static DynLib open(const std::vector<std::string>& candidates, const std::string& what) {
    std::string tried;
    for (const std::string& c : candidates) {
      if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) return DynLib(h, c);
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e ? e : "not found");
    }
    throw Error(what + ": cannot load the library; tried:" + tried +
                "\n(put its folder on LD_LIBRARY_PATH, or install it)");
  }
  DynLib(DynLib&& o) noexcept : handle_(o.handle_), name_(std::move(o.name_)) { o.handle_ = nullptr; }
  DynLib(const DynLib&) = delete;
  DynLib& operator=(const DynLib&) = delete;
  ~DynLib() = default;  // never closed: its functions may be in use until exit

  // The address of `symbol` as a function pointer of type F; throws naming the library.
  template <class F>
  F get(const char* symbol) const {
    void* p = dlsym(handle_, symbol);
    if (!p) throw Error(name_ + ": symbol " + symbol + " not found (a version too old for zinc?)");
    return reinterpret_cast<F>(p);
  }
  const std::string& name() const { return name_; }

 private:
  DynLib(void* h, std::string name) : handle_(h), name_(std::move(name)) {}
  void* handle_ = nullptr;
  std::string name_;
};

}  // namespace zinc
