// The single place where core errors become gRPC statuses.
#ifndef ELDR_SERVER_STATUS_CONVERSION_H_
#define ELDR_SERVER_STATUS_CONVERSION_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace eldr::server {

// Same canonical code (absl and gRPC share the numbering) and the same message, so a client sees
// exactly what the core said was wrong. Unknown codes become UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace eldr::server

#endif  // ELDR_SERVER_STATUS_CONVERSION_H_
