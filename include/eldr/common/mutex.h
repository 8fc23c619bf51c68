// eldr::Mutex: a mutual-exclusion lock with Abseil's thread-safety annotations (ABSL_GUARDED_BY
// and friends work with it), built on std::mutex.
//
// Why not absl::Mutex: Debian ships Abseil prebuilt without ThreadSanitizer instrumentation, and
// absl::Mutex synchronises through atomics inside that library, so a TSan build cannot see its
// happens-before edges and reports false data races on everything it guards. std::mutex goes
// through pthread, which TSan intercepts, so TSan builds stay meaningful. Uncontended lock/unlock
// costs about the same.
#ifndef ELDR_MUTEX_H_
#define ELDR_MUTEX_H_

#include <mutex>

#include "absl/base/thread_annotations.h"

namespace eldr {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// Holds `mu` for the scope (the absl::MutexLock idiom: takes a pointer).
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace eldr

#endif  // ELDR_MUTEX_H_
