// zinc core: folders to remove when the process ends early but can still act
// (a stop signal that ends it at once, an error that aborts the MPI job).
// Their owners remove them on a normal exit (destructors) and unregister
// them; remove_exit_folders() is for the exits that skip destructors
// (std::_Exit, MPI_Abort). A kill -9 leaves them: their owners clean up
// what a dead process left at their next start (the NVMe store removes
// zinc-rank<R>-<pid> folders of pids no longer running).
// Threading: any thread.
#pragma once

#include <string>

namespace zinc {

void register_exit_folder(const std::string& path);
void unregister_exit_folder(const std::string& path);
// Removes every registered folder (best effort, errors ignored); the
// registry is then empty.
void remove_exit_folders() noexcept;

}  // namespace zinc
