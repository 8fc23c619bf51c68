// Status propagation helpers. Abseil 20220623 (Debian bookworm) ships no status macros, so the
// project defines its own two, used by every module.
#ifndef ELDR_COMMON_STATUS_MACROS_H_
#define ELDR_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ELDR_STATUS_CONCAT_INNER_(a, b) a##b
#define ELDR_STATUS_CONCAT_(a, b) ELDR_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define ELDR_RETURN_IF_ERROR(expr)               \
  do {                                           \
    const ::absl::Status eldr_status_ = (expr);  \
    if (!eldr_status_.ok()) return eldr_status_; \
  } while (0)

// `lhs = value of rexpr` when rexpr (an absl::StatusOr) is OK; otherwise returns its status.
#define ELDR_ASSIGN_OR_RETURN(lhs, rexpr) \
  ELDR_ASSIGN_OR_RETURN_IMPL_(ELDR_STATUS_CONCAT_(eldr_statusor_, __LINE__), lhs, rexpr)
#define ELDR_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) return statusor.status();           \
  lhs = std::move(statusor).value()

#endif  // ELDR_COMMON_STATUS_MACROS_H_
