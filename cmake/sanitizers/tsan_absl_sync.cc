// ThreadSanitizer support for the system's Abseil (and everything built on it, gRPC included).
//
// Debian's libabsl_synchronization is not compiled with -fsanitize=thread, so TSan cannot see the
// happens-before that absl::Mutex, CondVar and Notification establish (they sleep on futexes, not
// on pthread primitives TSan intercepts): every field guarded by an absl::Mutex would be reported
// as a data race. This library, linked first into every executable of a TSan build (see
// cmake/TsanAbseilSync.cmake), interposes the out-of-line synchronization entry points: each
// definition below wins the dynamic symbol lookup (calls from our code, from libabsl itself and
// from libgrpc all go through the PLT), forwards to the real function found with
// dlsym(RTLD_NEXT), and tells TSan about the acquire/release it performs. A lock is an acquire
// of the mutex's address, an unlock a release; waits release before and acquire after; a
// Condition is evaluated after an acquire (the library evaluates it while holding the mutex).
// Races inside the uninstrumented libraries themselves are out of TSan's sight either way: run
// with TSAN_OPTIONS=ignore_noninstrumented_modules=1 (scripts/sanitize.sh, make sanitize-tsan).
//
// Only for TSan builds: it is not compiled otherwise.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define ELDR_TSAN_STR2(x) #x
#define ELDR_TSAN_STR(x) ELDR_TSAN_STR2(x)

// The mangled name of absl::<inline namespace>::<rest>: `rest` is written for the inline
// namespace "debian3" (Debian's) and rewritten for whatever this Abseil uses.
std::string Mangled(const char* rest_after_namespace, bool is_const = false) {
  const std::string ns = ELDR_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return std::string(is_const ? "_ZNK4absl" : "_ZN4absl") + std::to_string(ns.size()) + ns + rest_after_namespace;
}

template <typename Fn>
Fn Real(const char* rest_after_namespace) {
  const std::string name = Mangled(rest_after_namespace);
  void* symbol = dlsym(RTLD_NEXT, name.c_str());
  if (symbol == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: cannot find %s in the next library: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(symbol);
}

void Acquire(const void* address) { __tsan_acquire(const_cast<void*>(address)); }
void Release(const void* address) { __tsan_release(const_cast<void*>(address)); }

// A Condition is evaluated inside the library with the mutex held (by the waiter before it
// sleeps or after it re-took the mutex, or by the thread that unlocks it), out of the wrappers'
// sight: the replacement condition acquires the mutex's address, evaluates the caller's
// condition, and releases the address again, since the library may let the mutex go right after
// (a waiter going to sleep) without passing through Unlock.
class AcquiringCondition {
 public:
  AcquiringCondition(const absl::Mutex* mu, const absl::Condition& cond)
      : mu_(mu), cond_(&cond), condition_(&AcquiringCondition::Evaluate, static_cast<void*>(this)) {}
  const absl::Condition& condition() const { return condition_; }

 private:
  static bool Evaluate(void* self_pointer) {
    const auto* self = static_cast<const AcquiringCondition*>(self_pointer);
    Acquire(self->mu_);
    const bool result = self->cond_->Eval();
    Release(self->mu_);
    return result;
  }
  const absl::Mutex* mu_;
  const absl::Condition* cond_;
  absl::Condition condition_;
};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  Acquire(this);
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  Release(this);
  real(this);
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  Acquire(this);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  Release(this);
  real(this);
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  AcquiringCondition acquiring(this, cond);
  real(this, acquiring.condition());
  Acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, Duration)>("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), timeout);
  Acquire(this);  // held on return either way
  return result;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, Time)>("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), deadline);
  Acquire(this);
  return result;
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AcquiringCondition acquiring(this, cond);
  real(this, acquiring.condition());
  Acquire(this);
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), timeout);
  Acquire(this);
  return result;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, Time)>("5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), deadline);
  Acquire(this);
  return result;
}

void Mutex::Await(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  Release(this);
  AcquiringCondition acquiring(this, cond);
  real(this, acquiring.condition());
  Acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, Duration)>("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Release(this);
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), timeout);
  Acquire(this);
  return result;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, Time)>("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Release(this);
  AcquiringCondition acquiring(this, cond);
  const bool result = real(this, acquiring.condition(), deadline);
  Acquire(this);
  return result;
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  real(this, mu);
  Acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real =
      Real<bool (*)(CondVar*, Mutex*, Duration)>("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  const bool result = real(this, mu, timeout);
  Acquire(mu);
  return result;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Time)>("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  const bool result = real(this, mu, deadline);
  Acquire(mu);
  return result;
}

// The waits go through mutex_ (interposed above); HasBeenNotified() is an inline acquire load of
// notified_yet_, which follows mutex_ in the object: release that address too.
void Notification::Notify() {
  static const auto real = Real<void (*)(Notification*)>("12Notification6NotifyEv");
  static_assert(sizeof(Notification) >= sizeof(Mutex) + sizeof(std::atomic<bool>));
  Release(reinterpret_cast<const char*>(this) + sizeof(Mutex));
  real(this);
}

ABSL_NAMESPACE_END
}  // namespace absl
