// A synchronous Redis (or Valkey) connection on hiredis, for the background threads of the cluster
// module: never used on a routing path.
//
// Every command has a deadline (RedisConnectionOptions::command_timeout) for the whole exchange,
// sending and receiving, enforced with poll() on a non-blocking socket, so a hung or slow server
// costs a thread at most that long. The connection is made on first use and remade after any
// transport failure, with exponential backoff: while backing off, commands fail at once (no I/O)
// with kind kUnreachable, so a thread that loops over a dead Redis does not spin on connect().
// A timeout also backs off (a server that accepts connections but does not answer is not
// reconnected to at once, over and over). Making a connection: connect (connect_timeout), AUTH with the password file's
// contents (read at every connect, so a rotated secret is picked up), SELECT db, CLIENT SETNAME.
//
// Errors carry a RedisErrorKind (RedisErrorKindOf) beside their status code:
//   kUnreachable  UNAVAILABLE        refused, reset, closed, DNS, backing off; also LOADING/BUSY
//                                     replies (a server that cannot answer yet)
//   kTimeout      DEADLINE_EXCEEDED  the command's deadline (or connect_timeout) passed
//   kProtocol     INTERNAL           hiredis could not parse the stream, or a reply had an
//                                     unexpected shape (callers report those via CountError)
//   kReply        FAILED_PRECONDITION an error reply to an ordinary command (WRONGTYPE, OOM, ...)
//   kAuth         UNAUTHENTICATED    NOAUTH, WRONGPASS, an unreadable password file
//                                     (PERMISSION_DENIED for NOPERM)
//   kScript       INTERNAL           an error reply to EVAL/EVALSHA (the script failed)
// After a transport, timeout or protocol failure the connection is dropped (a late reply would
// otherwise be taken for the next command's).
//
// Scripts: Eval sends EVALSHA with the script's SHA-1 (learnt with SCRIPT LOAD the first time a
// connection runs it) and falls back to EVAL on NOSCRIPT, so scripts come back by themselves after
// a Redis restart or SCRIPT FLUSH.
//
// hiredis writes with write(2): Create sets SIGPIPE to SIG_IGN when it is still SIG_DFL (the
// daemons ignore it anyway), so a server that closed the connection costs an error, not the process.
//
// Thread-safety: one thread at a time uses a connection (it is not locked); Stats() may be read
// from any thread.
#ifndef ELDR_CLUSTER_REDIS_CONNECTION_H_
#define ELDR_CLUSTER_REDIS_CONNECTION_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct redisContext;

namespace eldr::cluster {

enum class RedisErrorKind { kUnreachable = 0, kTimeout, kProtocol, kReply, kAuth, kScript };
inline constexpr int kRedisErrorKinds = 6;
// "unreachable", "timeout", "protocol", "reply", "auth", "script" (metric label values).
absl::string_view RedisErrorKindLabel(RedisErrorKind kind);

// A status of `code` and `message` that carries `kind`.
absl::Status RedisError(RedisErrorKind kind, absl::StatusCode code, absl::string_view message);
// The kind a status carries; nullopt for OK and for statuses not made by RedisError.
std::optional<RedisErrorKind> RedisErrorKindOf(const absl::Status& status);

// Where the server is: "host:port", "host" (port 6379), "[ipv6]:port", or "unix:/path/to/socket".
struct RedisAddress {
  std::string host;  // empty for a Unix socket
  int port = 6379;
  std::string unix_path;  // non-empty for a Unix socket
};
absl::StatusOr<RedisAddress> ParseRedisAddress(absl::string_view text);
std::string RedisAddressString(const RedisAddress& address);

struct RedisConnectionOptions {
  std::string address = "127.0.0.1:6379";  // see ParseRedisAddress
  // File holding the password (surrounding whitespace and a trailing newline are ignored). Empty:
  // no AUTH. With `username`, AUTH <username> <password> (Redis 6 ACL users).
  std::string password_file;
  std::string username;
  int db = 0;  // SELECT db when not 0; in [0, 1 << 20)
  // Sent as CLIENT SETNAME (shows in CLIENT LIST); letters, digits and -_.:@/+ only. Empty: none.
  std::string client_name;
  absl::Duration connect_timeout = absl::Seconds(1);
  absl::Duration command_timeout = absl::Seconds(1);  // the whole exchange of one command or pipeline
  // Reconnection: the first attempt after a working connection broke is immediate, then the delay
  // doubles from min_backoff to max_backoff (with +-20% jitter) until a connection is made.
  absl::Duration min_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // A reply larger than this is a protocol error (a misdirected read of a huge key).
  size_t max_reply_bytes = size_t{512} << 20;
};

// INVALID_ARGUMENT naming the field: address, db range, client name, positive timeouts,
// 0 < min_backoff <= max_backoff.
absl::Status ValidateRedisConnectionOptions(const RedisConnectionOptions& options);

// A reply, copied out of hiredis.
struct RedisReply {
  enum class Type { kNil, kString, kStatus, kInteger, kArray, kError };
  Type type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  int64_t integer = 0;
  std::vector<RedisReply> elements;  // kArray

  bool is_nil() const { return type == Type::kNil; }
  bool is_error() const { return type == Type::kError; }
};

// A Lua script run with Eval. The source is the identity: keep the object alive as long as the
// connections that ran it (they remember its SHA-1 by address).
class RedisScript {
 public:
  explicit RedisScript(std::string source) : source_(std::move(source)) {}
  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

struct RedisConnectionStats {
  int64_t connects = 0;          // connections made (the first one included)
  int64_t connect_failures = 0;  // attempts that failed (backoff refusals excluded)
  int64_t commands = 0;          // commands and pipelines sent
  int64_t noscript_fallbacks = 0;
  std::array<int64_t, kRedisErrorKinds> errors{};  // failures by RedisErrorKind (backoff refusals excluded)
  bool connected = false;
};

class RedisConnection {
 public:
  // INVALID_ARGUMENT for bad options. Does not connect.
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Create(RedisConnectionOptions options);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Connects now unless connected; the errors of a failed attempt (or the backoff refusal).
  absl::Status Connect();
  // Drops the connection (the next command reconnects at once, without backoff).
  void Disconnect();
  bool connected() const { return context_ != nullptr; }

  // One command. An error reply becomes an error status (kReply, kAuth, ...); every other reply is
  // returned as is.
  absl::StatusOr<RedisReply> Command(const std::vector<std::string>& argv);
  // Several commands in one round trip (one deadline for all). Error replies stay in the vector as
  // kError elements; only transport, timeout and protocol failures fail the whole call.
  absl::StatusOr<std::vector<RedisReply>> Pipeline(const std::vector<std::vector<std::string>>& commands);
  // EVALSHA (EVAL on NOSCRIPT) of `script` with its KEYS and ARGV. Error replies become kScript
  // errors (kAuth, kUnreachable for NOAUTH, LOADING and the like).
  absl::StatusOr<RedisReply> Eval(const RedisScript& script, const std::vector<std::string>& keys,
                                  const std::vector<std::string>& args);

  // For a connection in subscribe mode (after a SUBSCRIBE command): the next pushed message, or
  // nullopt when none arrived within `wait` (not an error; the connection stays). Does not
  // reconnect: after a failure the caller subscribes again.
  absl::StatusOr<std::optional<RedisReply>> ReadPush(absl::Duration wait);

  // Counts a failure of `kind` that the caller found in a reply (an unexpected shape: kProtocol).
  void CountError(RedisErrorKind kind);
  RedisConnectionStats Stats() const;
  const RedisConnectionOptions& options() const { return options_; }

 private:
  RedisConnection(RedisConnectionOptions options, RedisAddress address);
  absl::Status ConnectLocked();
  // Sends what hiredis has buffered and reads `replies` replies before `deadline`.
  absl::StatusOr<std::vector<RedisReply>> Exchange(size_t replies, absl::Time deadline);
  absl::StatusOr<std::vector<RedisReply>> Send(const std::vector<std::vector<std::string>>& commands,
                                               absl::Time deadline);
  // Fails the connection: counts, drops it, schedules the next attempt.
  absl::Status Fail(absl::Status status);
  void DropContext();
  void ScheduleReconnect();

  const RedisConnectionOptions options_;
  const RedisAddress address_;
  redisContext* context_ = nullptr;
  absl::Time next_attempt_ = absl::InfinitePast();
  int failed_attempts_ = 0;  // consecutive failed connects and timeouts (the backoff exponent)
  bool in_handshake_ = false;
  std::string last_connect_error_;
  uint64_t jitter_state_;
  absl::flat_hash_map<const RedisScript*, std::string> shas_;

  std::atomic<int64_t> connects_{0};
  std::atomic<int64_t> connect_failures_{0};
  std::atomic<int64_t> commands_{0};
  std::atomic<int64_t> noscript_fallbacks_{0};
  std::array<std::atomic<int64_t>, kRedisErrorKinds> errors_{};
  std::atomic<bool> connected_{false};
};

}  // namespace eldr::cluster

#endif  // ELDR_CLUSTER_REDIS_CONNECTION_H_
