#include "core/exit_cleanup.h"

#include <filesystem>
#include <mutex>
#include <set>

namespace zinc {
namespace {
std::mutex g_mutex;
std::set<std::string>& folders() {
  static auto* s = new std::set<std::string>;  // never destroyed: used from exits that skip destructors
  return *s;
}
}  // namespace

void register_exit_folder(const std::string& path) {
  std::lock_guard<std::mutex> g(g_mutex);
  folders().insert(path);
}

void unregister_exit_folder(const std::string& path) {
  std::lock_guard<std::mutex> g(g_mutex);
  folders().erase(path);
}

void remove_exit_folders() noexcept {
  std::lock_guard<std::mutex> g(g_mutex);
  for (const std::string& f : folders()) {
    std::error_code ec;
    std::filesystem::remove_all(f, ec);
  }
  folders().clear();
}

}  // namespace zinc
