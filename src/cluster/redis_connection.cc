#include "eldr/cluster/redis_connection.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "eldr/common/file.h"

namespace eldr::cluster {
namespace {

constexpr absl::string_view kKindPayload = "type.eldr.dev/eldr.cluster.RedisErrorKind";

bool IsNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':' ||
         c == '@' || c == '/' || c == '+';
}

void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

RedisReply Convert(const redisReply* raw) {
  RedisReply reply;
  switch (raw->type) {
    case REDIS_REPLY_STRING:
      reply.type = RedisReply::Type::kString;
      reply.str.assign(raw->str, raw->len);
      break;
    case REDIS_REPLY_STATUS:
      reply.type = RedisReply::Type::kStatus;
      reply.str.assign(raw->str, raw->len);
      break;
    case REDIS_REPLY_ERROR:
      reply.type = RedisReply::Type::kError;
      reply.str.assign(raw->str, raw->len);
      break;
    case REDIS_REPLY_INTEGER:
      reply.type = RedisReply::Type::kInteger;
      reply.integer = raw->integer;
      break;
    case REDIS_REPLY_ARRAY:
      reply.type = RedisReply::Type::kArray;
      reply.elements.reserve(raw->elements);
      for (size_t i = 0; i < raw->elements; ++i) reply.elements.push_back(Convert(raw->element[i]));
      break;
    default:
      reply.type = RedisReply::Type::kNil;
      break;
  }
  return reply;
}

// The kind of an error reply (its first word), for a command that was (not) a script.
absl::Status ErrorFromReply(const RedisReply& reply, bool script, absl::string_view what) {
  const absl::string_view text = reply.str;
  const absl::string_view word = text.substr(0, text.find(' '));
  const std::string message = absl::StrCat(what, ": ", text);
  if (word == "NOAUTH" || word == "WRONGPASS") {
    return RedisError(RedisErrorKind::kAuth, absl::StatusCode::kUnauthenticated, message);
  }
  if (word == "NOPERM") return RedisError(RedisErrorKind::kAuth, absl::StatusCode::kPermissionDenied, message);
  if (word == "LOADING" || word == "BUSY" || word == "MASTERDOWN" || word == "TRYAGAIN" || word == "CLUSTERDOWN") {
    return RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable, message);
  }
  if (script) return RedisError(RedisErrorKind::kScript, absl::StatusCode::kInternal, message);
  return RedisError(RedisErrorKind::kReply, absl::StatusCode::kFailedPrecondition, message);
}

uint64_t NextRandom(uint64_t* state) {  // splitmix64
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Waits for `events` on `fd` until `deadline`: 1 ready, 0 deadline passed, -1 poll failed.
int WaitFd(int fd, short events, absl::Time deadline) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, ms);
    if (rc > 0) return 1;
    if (rc < 0 && errno != EINTR) return -1;
  }
}

}  // namespace

absl::string_view RedisErrorKindLabel(RedisErrorKind kind) {
  switch (kind) {
    case RedisErrorKind::kUnreachable:
      return "unreachable";
    case RedisErrorKind::kTimeout:
      return "timeout";
    case RedisErrorKind::kProtocol:
      return "protocol";
    case RedisErrorKind::kReply:
      return "reply";
    case RedisErrorKind::kAuth:
      return "auth";
    case RedisErrorKind::kScript:
      return "script";
  }
  return "unknown";
}

absl::Status RedisError(RedisErrorKind kind, absl::StatusCode code, absl::string_view message) {
  absl::Status status(code, message);
  status.SetPayload(kKindPayload, absl::Cord(RedisErrorKindLabel(kind)));
  return status;
}

std::optional<RedisErrorKind> RedisErrorKindOf(const absl::Status& status) {
  if (status.ok()) return std::nullopt;
  absl::optional<absl::Cord> payload = status.GetPayload(kKindPayload);
  if (!payload) return std::nullopt;
  for (int i = 0; i < kRedisErrorKinds; ++i) {
    const auto kind = static_cast<RedisErrorKind>(i);
    if (*payload == RedisErrorKindLabel(kind)) return kind;
  }
  return std::nullopt;
}

absl::StatusOr<RedisAddress> ParseRedisAddress(absl::string_view text) {
  RedisAddress address;
  if (absl::ConsumePrefix(&text, "unix:")) {
    if (text.empty() || text[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat("redis address: unix socket path must be absolute: '", text, "'"));
    }
    address.unix_path = std::string(text);
    return address;
  }
  absl::string_view host = text;
  absl::string_view port;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) return absl::InvalidArgumentError("redis address: unclosed '['");
    host = text.substr(1, close - 1);
    absl::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (!absl::ConsumePrefix(&rest, ":")) return absl::InvalidArgumentError("redis address: junk after ']'");
      port = rest;
    }
  } else if (const size_t colon = text.rfind(':'); colon != absl::string_view::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) return absl::InvalidArgumentError(absl::StrCat("redis address: no host in '", text, "'"));
  for (char c : host) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' || c == ':')) {
      return absl::InvalidArgumentError(absl::StrCat("redis address: bad host '", host, "'"));
    }
  }
  if (!port.empty()) {
    int value = 0;
    if (!absl::SimpleAtoi(port, &value) || value < 1 || value > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("redis address: bad port '", port, "'"));
    }
    address.port = value;
  }
  address.host = std::string(host);
  return address;
}

std::string RedisAddressString(const RedisAddress& address) {
  if (!address.unix_path.empty()) return absl::StrCat("unix:", address.unix_path);
  if (absl::StrContains(address.host, ':')) return absl::StrCat("[", address.host, "]:", address.port);
  return absl::StrCat(address.host, ":", address.port);
}

absl::Status ValidateRedisConnectionOptions(const RedisConnectionOptions& options) {
  absl::StatusOr<RedisAddress> address = ParseRedisAddress(options.address);
  if (!address.ok()) return address.status();
  if (options.db < 0 || options.db >= (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("redis db ", options.db, " out of range"));
  }
  if (!std::all_of(options.client_name.begin(), options.client_name.end(), IsNameChar)) {
    return absl::InvalidArgumentError(absl::StrCat("redis client name '", options.client_name, "' has bad characters"));
  }
  if (!std::all_of(options.username.begin(), options.username.end(), IsNameChar)) {
    return absl::InvalidArgumentError("redis username has bad characters");
  }
  if (options.connect_timeout <= absl::ZeroDuration() || options.command_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("redis timeouts must be positive");
  }
  if (options.min_backoff <= absl::ZeroDuration() || options.max_backoff < options.min_backoff) {
    return absl::InvalidArgumentError("redis backoff: need 0 < min_backoff <= max_backoff");
  }
  if (options.max_reply_bytes == 0) return absl::InvalidArgumentError("redis max_reply_bytes must be positive");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::Create(RedisConnectionOptions options) {
  absl::Status valid = ValidateRedisConnectionOptions(options);
  if (!valid.ok()) return valid;
  IgnoreSigpipeOnce();
  RedisAddress address = *ParseRedisAddress(options.address);
  return std::unique_ptr<RedisConnection>(new RedisConnection(std::move(options), std::move(address)));
}

RedisConnection::RedisConnection(RedisConnectionOptions options, RedisAddress address)
    : options_(std::move(options)),
      address_(std::move(address)),
      jitter_state_(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^ reinterpret_cast<uintptr_t>(this)) {}

RedisConnection::~RedisConnection() { DropContext(); }

void RedisConnection::DropContext() {
  if (context_ != nullptr) redisFree(context_);
  context_ = nullptr;
  connected_.store(false, std::memory_order_relaxed);
}

void RedisConnection::Disconnect() {
  DropContext();
  failed_attempts_ = 0;
  next_attempt_ = absl::InfinitePast();
}

void RedisConnection::ScheduleReconnect() {
  if (failed_attempts_ == 0) {
    next_attempt_ = absl::InfinitePast();
    return;
  }
  absl::Duration delay = options_.min_backoff * std::pow(2.0, std::min(failed_attempts_ - 1, 30));
  delay = std::min(delay, options_.max_backoff);
  const double jitter = 0.8 + 0.4 * static_cast<double>(NextRandom(&jitter_state_) >> 11) / 9007199254740992.0;
  next_attempt_ = absl::Now() + delay * jitter;
}

absl::Status RedisConnection::Fail(absl::Status status) {
  DropContext();
  if (in_handshake_) return status;  // Connect counts and schedules the failed attempt once
  const std::optional<RedisErrorKind> kind = RedisErrorKindOf(status);
  if (kind) errors_[static_cast<int>(*kind)].fetch_add(1, std::memory_order_relaxed);
  // A server that accepts connections but does not answer (hung, overloaded) must not be
  // reconnected to at once, over and over: timeouts back off like failed connects.
  if (kind == RedisErrorKind::kTimeout) ++failed_attempts_;
  ScheduleReconnect();
  return status;
}

void RedisConnection::CountError(RedisErrorKind kind) {
  errors_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
}

absl::Status RedisConnection::Connect() {
  if (context_ != nullptr) return absl::OkStatus();
  const absl::Time now = absl::Now();
  if (now < next_attempt_) {
    return RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                      absl::StrCat("redis ", RedisAddressString(address_), " unreachable (next attempt in ",
                                   absl::FormatDuration(absl::Trunc(next_attempt_ - now, absl::Milliseconds(1))),
                                   "; last error: ", last_connect_error_, ")"));
  }
  in_handshake_ = true;
  absl::Status status = ConnectLocked();
  in_handshake_ = false;
  if (status.ok()) {
    next_attempt_ = absl::InfinitePast();
    connects_.fetch_add(1, std::memory_order_relaxed);
    connected_.store(true, std::memory_order_relaxed);
    return status;
  }
  ++failed_attempts_;
  connect_failures_.fetch_add(1, std::memory_order_relaxed);
  last_connect_error_ = std::string(status.message());
  if (std::optional<RedisErrorKind> kind = RedisErrorKindOf(status)) {
    errors_[static_cast<int>(*kind)].fetch_add(1, std::memory_order_relaxed);
  }
  DropContext();
  ScheduleReconnect();
  return status;
}

absl::Status RedisConnection::ConnectLocked() {
  const std::string where = RedisAddressString(address_);
  // Read the secret first: an unreadable password file is a configuration error, no connect needed.
  std::string password;
  if (!options_.password_file.empty()) {
    absl::StatusOr<std::string> secret = ReadFile(options_.password_file, 1 << 16);
    if (!secret.ok()) {
      return RedisError(RedisErrorKind::kAuth, absl::StatusCode::kUnauthenticated,
                        absl::StrCat("redis password file: ", secret.status().message()));
    }
    password = std::string(absl::StripAsciiWhitespace(*secret));
  }
  timeval tv{};
  const int64_t us = absl::ToInt64Microseconds(options_.connect_timeout);
  tv.tv_sec = us / 1000000;
  tv.tv_usec = us % 1000000;
  errno = 0;
  redisContext* c = address_.unix_path.empty() ? redisConnectWithTimeout(address_.host.c_str(), address_.port, tv)
                                               : redisConnectUnixWithTimeout(address_.unix_path.c_str(), tv);
  if (c == nullptr) {
    return RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                      absl::StrCat("redis ", where, ": cannot allocate a context"));
  }
  if (c->err != 0) {
    const bool timed_out = errno == ETIMEDOUT || absl::StrContains(c->errstr, "timed out");
    std::string message = absl::StrCat("redis ", where, ": connect: ", c->errstr);
    redisFree(c);
    return timed_out ? RedisError(RedisErrorKind::kTimeout, absl::StatusCode::kDeadlineExceeded, message)
                     : RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable, message);
  }
  // From here on every exchange is driven by poll() against a deadline.
  const int flags = fcntl(c->fd, F_GETFL);
  if (flags < 0 || fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    redisFree(c);
    return RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                      absl::StrCat("redis ", where, ": fcntl: ", std::strerror(errno)));
  }
  c->flags &= ~REDIS_BLOCK;
  if (address_.unix_path.empty()) redisEnableKeepAlive(c);
  context_ = c;

  std::vector<std::vector<std::string>> handshake;
  std::vector<std::string> what;
  if (!options_.password_file.empty()) {
    if (options_.username.empty()) {
      handshake.push_back({"AUTH", password});
    } else {
      handshake.push_back({"AUTH", options_.username, password});
    }
    what.push_back("AUTH");
  }
  if (options_.db != 0) {
    handshake.push_back({"SELECT", absl::StrCat(options_.db)});
    what.push_back("SELECT");
  }
  if (!options_.client_name.empty()) {
    handshake.push_back({"CLIENT", "SETNAME", options_.client_name});
    what.push_back("CLIENT SETNAME");
  }
  if (handshake.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<RedisReply>> replies = Send(handshake, absl::Now() + options_.connect_timeout);
  if (!replies.ok()) return replies.status();  // Send dropped the context
  for (size_t i = 0; i < replies->size(); ++i) {
    const RedisReply& reply = (*replies)[i];
    if (!reply.is_error()) continue;
    DropContext();
    if (what[i] == "AUTH") {
      return RedisError(RedisErrorKind::kAuth, absl::StatusCode::kUnauthenticated,
                        absl::StrCat("redis ", where, ": AUTH: ", reply.str));
    }
    return ErrorFromReply(reply, false, absl::StrCat("redis ", where, ": ", what[i]));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RedisReply>> RedisConnection::Send(const std::vector<std::vector<std::string>>& commands,
                                                              absl::Time deadline) {
  for (const std::vector<std::string>& argv : commands) {
    std::vector<const char*> args;
    std::vector<size_t> lengths;
    args.reserve(argv.size());
    lengths.reserve(argv.size());
    for (const std::string& arg : argv) {
      args.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    if (redisAppendCommandArgv(context_, static_cast<int>(args.size()), args.data(), lengths.data()) != REDIS_OK) {
      return RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal,
                        absl::StrCat("redis: cannot format a command: ", context_->errstr));
    }
  }
  commands_.fetch_add(1, std::memory_order_relaxed);
  return Exchange(commands.size(), deadline);
}

absl::StatusOr<std::vector<RedisReply>> RedisConnection::Exchange(size_t count, absl::Time deadline) {
  const std::string where = RedisAddressString(address_);
  auto io_error = [&](absl::string_view op) {
    const int saved = errno;
    const std::string message = absl::StrCat("redis ", where, ": ", op, ": ", context_->errstr);
    if (context_->err == REDIS_ERR_IO && (saved == EAGAIN || saved == EWOULDBLOCK || saved == ETIMEDOUT)) {
      return Fail(RedisError(RedisErrorKind::kTimeout, absl::StatusCode::kDeadlineExceeded, message));
    }
    if (context_->err == REDIS_ERR_IO || context_->err == REDIS_ERR_EOF) {
      return Fail(RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable, message));
    }
    return Fail(RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal, message));
  };
  auto timeout = [&](absl::string_view op) {
    return Fail(RedisError(
        RedisErrorKind::kTimeout, absl::StatusCode::kDeadlineExceeded,
        absl::StrCat("redis ", where, ": ", op, " timed out after ", absl::FormatDuration(options_.command_timeout))));
  };
  int done = 0;
  while (true) {
    errno = 0;
    if (redisBufferWrite(context_, &done) == REDIS_ERR) return io_error("write");
    if (done) break;
    const int ready = WaitFd(context_->fd, POLLOUT, deadline);
    if (ready == 0) return timeout("write");
    if (ready < 0) {
      return Fail(RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                             absl::StrCat("redis ", where, ": poll: ", std::strerror(errno))));
    }
  }
  std::vector<RedisReply> replies;
  replies.reserve(count);
  while (replies.size() < count) {
    void* raw = nullptr;
    if (redisGetReplyFromReader(context_, &raw) == REDIS_ERR) return io_error("read");
    if (raw != nullptr) {
      replies.push_back(Convert(static_cast<redisReply*>(raw)));
      freeReplyObject(raw);
      continue;
    }
    if (context_->reader != nullptr && context_->reader->len > options_.max_reply_bytes) {
      return Fail(RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal,
                             absl::StrCat("redis ", where, ": reply over ", options_.max_reply_bytes, " bytes")));
    }
    const int ready = WaitFd(context_->fd, POLLIN, deadline);
    if (ready == 0) return timeout("read");
    if (ready < 0) {
      return Fail(RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                             absl::StrCat("redis ", where, ": poll: ", std::strerror(errno))));
    }
    errno = 0;
    if (redisBufferRead(context_) == REDIS_ERR) return io_error("read");
  }
  failed_attempts_ = 0;  // the server answers: the next failure reconnects at once
  return replies;
}

absl::StatusOr<std::vector<RedisReply>> RedisConnection::Pipeline(
    const std::vector<std::vector<std::string>>& commands) {
  if (commands.empty()) return std::vector<RedisReply>();
  absl::Status connected = Connect();
  if (!connected.ok()) return connected;
  absl::StatusOr<std::vector<RedisReply>> replies = Send(commands, absl::Now() + options_.command_timeout);
  if (replies.ok()) {
    for (const RedisReply& reply : *replies) {
      if (!reply.is_error()) continue;
      if (std::optional<RedisErrorKind> kind = RedisErrorKindOf(ErrorFromReply(reply, false, ""))) CountError(*kind);
    }
  }
  return replies;
}

absl::StatusOr<RedisReply> RedisConnection::Command(const std::vector<std::string>& argv) {
  absl::StatusOr<std::vector<RedisReply>> replies = Pipeline({argv});
  if (!replies.ok()) return replies.status();
  RedisReply& reply = replies->front();
  if (reply.is_error()) return ErrorFromReply(reply, false, argv.empty() ? "redis" : absl::StrCat("redis ", argv[0]));
  return std::move(reply);
}

absl::StatusOr<RedisReply> RedisConnection::Eval(const RedisScript& script, const std::vector<std::string>& keys,
                                                 const std::vector<std::string>& args) {
  absl::Status connected = Connect();
  if (!connected.ok()) return connected;
  auto it = shas_.find(&script);
  if (it == shas_.end()) {
    absl::StatusOr<RedisReply> loaded = Command({"SCRIPT", "LOAD", script.source()});
    if (!loaded.ok()) return loaded.status();
    if (loaded->type != RedisReply::Type::kString || loaded->str.size() != 40) {
      CountError(RedisErrorKind::kProtocol);
      return RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal, "redis SCRIPT LOAD: not a SHA-1");
    }
    it = shas_.emplace(&script, loaded->str).first;
  }
  std::vector<std::string> argv;
  argv.reserve(3 + keys.size() + args.size());
  argv.push_back("EVALSHA");
  argv.push_back(it->second);
  argv.push_back(absl::StrCat(keys.size()));
  argv.insert(argv.end(), keys.begin(), keys.end());
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::vector<RedisReply>> replies = Send({argv}, absl::Now() + options_.command_timeout);
  if (!replies.ok()) return replies.status();
  if (replies->front().is_error() && absl::StartsWith(replies->front().str, "NOSCRIPT")) {
    // The server lost its script cache (restart, SCRIPT FLUSH): EVAL sends the source and caches it.
    noscript_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    argv[0] = "EVAL";
    argv[1] = script.source();
    replies = Send({argv}, absl::Now() + options_.command_timeout);
    if (!replies.ok()) return replies.status();
  }
  RedisReply& reply = replies->front();
  if (reply.is_error()) {
    absl::Status error = ErrorFromReply(reply, true, "redis script");
    CountError(*RedisErrorKindOf(error));
    return error;
  }
  return std::move(reply);
}

absl::StatusOr<std::optional<RedisReply>> RedisConnection::ReadPush(absl::Duration wait) {
  if (context_ == nullptr) {
    return RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable, "redis: not connected");
  }
  const std::string where = RedisAddressString(address_);
  for (int round = 0; round < 2; ++round) {
    void* raw = nullptr;
    if (redisGetReplyFromReader(context_, &raw) == REDIS_ERR) {
      return Fail(RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal,
                             absl::StrCat("redis ", where, ": read: ", context_->errstr)));
    }
    if (raw != nullptr) {
      RedisReply reply = Convert(static_cast<redisReply*>(raw));
      freeReplyObject(raw);
      return std::optional<RedisReply>(std::move(reply));
    }
    if (round == 1) break;
    const int ready = WaitFd(context_->fd, POLLIN, absl::Now() + wait);
    if (ready == 0) return std::optional<RedisReply>();
    if (ready < 0) {
      return Fail(RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable,
                             absl::StrCat("redis ", where, ": poll: ", std::strerror(errno))));
    }
    errno = 0;
    if (redisBufferRead(context_) == REDIS_ERR) {
      const std::string message = absl::StrCat("redis ", where, ": read: ", context_->errstr);
      const bool protocol = context_->err != REDIS_ERR_IO && context_->err != REDIS_ERR_EOF;
      return Fail(protocol ? RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal, message)
                           : RedisError(RedisErrorKind::kUnreachable, absl::StatusCode::kUnavailable, message));
    }
  }
  return std::optional<RedisReply>();
}

RedisConnectionStats RedisConnection::Stats() const {
  RedisConnectionStats stats;
  stats.connects = connects_.load(std::memory_order_relaxed);
  stats.connect_failures = connect_failures_.load(std::memory_order_relaxed);
  stats.commands = commands_.load(std::memory_order_relaxed);
  stats.noscript_fallbacks = noscript_fallbacks_.load(std::memory_order_relaxed);
  for (int i = 0; i < kRedisErrorKinds; ++i) stats.errors[i] = errors_[i].load(std::memory_order_relaxed);
  stats.connected = connected_.load(std::memory_order_relaxed);
  return stats;
}

}  // namespace eldr::cluster
