#include "eldr/cluster/cluster_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace eldr::cluster {
namespace {

// Lua 5.1 (Redis's): numbers are doubles, exact up to 2^53, far above any fence or generation.
// string.format('%d', x) writes them without an exponent.
const RedisScript kAcquireScript(R"lua(
local ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if not ok then
  local holder = redis.call('GET', KEYS[1]) or ''
  return {0, holder, tonumber(redis.call('GET', KEYS[2]) or '0'), redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if fence <= floor then
  fence = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', fence))
end
local value = ARGV[1] .. '|' .. string.format('%d', fence)
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {1, value, fence, tonumber(ARGV[2])}
)lua");

const RedisScript kRenewScript(R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
)lua");

// ARGV: the lease value, the leader channel.
const RedisScript kReleaseScript(R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released ' .. ARGV[1])
  return 1
end
return 0
)lua");

// KEYS: fence, centroids:gen, centroids. ARGV: fence, generation floor, data, channel, replica.
const RedisScript kPublishScript(R"lua(
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= tonumber(ARGV[1]) then return {0, 0, current} end
local gen = tonumber(redis.call('GET', KEYS[2]) or '0')
local floor = tonumber(ARGV[2])
if floor > gen then gen = floor end
gen = gen + 1
local g = string.format('%d', gen)
redis.call('SET', KEYS[2], g)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'gen', g, 'fence', ARGV[1], 'by', ARGV[5], 'at_ms', string.format('%d', now), 'data', ARGV[3])
redis.call('PUBLISH', ARGV[4], g)
return {1, gen, current}
)lua");

const RedisScript kRaiseFloorScript(R"lua(
local g = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if g < floor then
  redis.call('SET', KEYS[1], ARGV[1])
  return floor
end
return g
)lua");

// KEYS: leases:<replica>, replicas. ARGV: ttl ms, replica, stale ms, then field/value pairs.
const RedisScript kLoadScript(R"lua(
redis.call('DEL', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], '#at', string.format('%d', now))
local n = #ARGV
local i = 4
while i <= n do
  local j = math.min(i + 999, n)
  redis.call('HSET', KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%d', now - tonumber(ARGV[3])))
return now
)lua");

bool IsIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == ':' ||
         c == '@' || c == '/' || c == '+';
}

std::string Millis(absl::Duration d) { return absl::StrCat(std::max<int64_t>(1, absl::ToInt64Milliseconds(d))); }

bool ParseU64(const RedisReply& reply, uint64_t* out) {
  if (reply.type == RedisReply::Type::kInteger) {
    if (reply.integer < 0) return false;
    *out = static_cast<uint64_t>(reply.integer);
    return true;
  }
  if (reply.type == RedisReply::Type::kString) return absl::SimpleAtoi(reply.str, out);
  return false;
}

bool ParseI64(absl::string_view text, int64_t* out) { return absl::SimpleAtoi(text, out); }

absl::Time StreamIdTime(absl::string_view id) {
  int64_t ms = 0;
  const size_t dash = id.find('-');
  if (!ParseI64(id.substr(0, dash), &ms)) return absl::UnixEpoch();
  return absl::FromUnixMillis(ms);
}

}  // namespace

absl::Status ValidateClusterName(absl::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat("cluster name '", name, "': 1 to 64 characters"));
  }
  for (char c : name) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(absl::StrCat("cluster name '", name, "': letters, digits and . _ - only"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateReplicaId(absl::string_view id) {
  if (id.empty() || id.size() > 253) {
    return absl::InvalidArgumentError(absl::StrCat("replica id '", id, "': 1 to 253 characters"));
  }
  if (!std::all_of(id.begin(), id.end(), IsIdChar)) {
    return absl::InvalidArgumentError(absl::StrCat("replica id '", id, "': letters, digits and . _ - : @ / + only"));
  }
  return absl::OkStatus();
}

ClusterKeys::ClusterKeys(absl::string_view cluster_name) : prefix_(absl::StrCat("eldr:{", cluster_name, "}")) {}

std::string ClusterKeys::leases(absl::string_view replica_id) const {
  return absl::StrCat(prefix_, ":leases:", replica_id);
}

ClusterStore::ClusterStore(RedisConnection* connection, ClusterKeys keys)
    : connection_(connection), keys_(std::move(keys)) {}

absl::Status ClusterStore::Shape(absl::string_view what) {
  connection_->CountError(RedisErrorKind::kProtocol);
  return RedisError(RedisErrorKind::kProtocol, absl::StatusCode::kInternal,
                    absl::StrCat("redis: unexpected reply to ", what));
}

absl::StatusOr<LeaderAcquisition> ClusterStore::TryAcquireLeader(absl::string_view replica_id, absl::Duration lease,
                                                                 uint64_t fence_floor) {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Eval(kAcquireScript, {keys_.leader(), keys_.fence()},
                                          {std::string(replica_id), Millis(lease), absl::StrCat(fence_floor)}));
  if (reply.type != RedisReply::Type::kArray || reply.elements.size() != 4 ||
      reply.elements[0].type != RedisReply::Type::kInteger || reply.elements[1].type != RedisReply::Type::kString) {
    return Shape("the leader acquisition");
  }
  LeaderAcquisition result;
  result.acquired = reply.elements[0].integer == 1;
  if (!ParseU64(reply.elements[2], &result.fence)) return Shape("the leader acquisition (fence)");
  const std::string& value = reply.elements[1].str;
  result.holder = value.substr(0, value.rfind('|'));
  // PTTL: milliseconds left (0 when under one), -1 for a key without expiry (not ours: someone
  // set it by hand), -2 when gone.
  const RedisReply& pttl = reply.elements[3];
  if (pttl.type != RedisReply::Type::kInteger) return Shape("the leader acquisition (ttl)");
  result.remaining =
      pttl.integer == -1 ? absl::InfiniteDuration() : absl::Milliseconds(std::max<int64_t>(0, pttl.integer));
  return result;
}

absl::StatusOr<bool> ClusterStore::RenewLeader(absl::string_view replica_id, uint64_t fence, absl::Duration lease) {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply, connection_->Eval(kRenewScript, {keys_.leader()},
                                                            {absl::StrCat(replica_id, "|", fence), Millis(lease)}));
  if (reply.type != RedisReply::Type::kInteger) return Shape("the lease renewal");
  return reply.integer == 1;
}

absl::StatusOr<bool> ClusterStore::ReleaseLeader(absl::string_view replica_id, uint64_t fence) {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Eval(kReleaseScript, {keys_.leader()},
                                          {absl::StrCat(replica_id, "|", fence), keys_.leader_announce()}));
  if (reply.type != RedisReply::Type::kInteger) return Shape("the lease release");
  return reply.integer == 1;
}

absl::StatusOr<LeaderInfo> ClusterStore::ReadLeader() {
  ELDR_ASSIGN_OR_RETURN(
      std::vector<RedisReply> replies,
      connection_->Pipeline({{"GET", keys_.leader()}, {"GET", keys_.fence()}, {"PTTL", keys_.leader()}}));
  LeaderInfo info;
  if (replies[0].type == RedisReply::Type::kString) {
    const std::string& value = replies[0].str;
    const size_t bar = value.rfind('|');
    info.holder = value.substr(0, bar);
    if (bar == std::string::npos || !absl::SimpleAtoi(absl::string_view(value).substr(bar + 1), &info.holder_fence)) {
      info.holder_fence = 0;  // not a value this module wrote
    }
  } else if (!replies[0].is_nil()) {
    return Shape("GET leader");
  }
  if (!replies[1].is_nil() && !ParseU64(replies[1], &info.fence)) return Shape("GET fence");
  if (replies[2].type == RedisReply::Type::kInteger && replies[2].integer > 0) {
    info.remaining = absl::Milliseconds(replies[2].integer);
  }
  return info;
}

absl::StatusOr<PublishResult> ClusterStore::PublishCentroids(absl::string_view encoded, uint64_t fence,
                                                             uint64_t generation_floor, absl::string_view replica_id) {
  if (fence == 0) return absl::InvalidArgumentError("publish: fencing generation 0 (never a leader's)");
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Eval(kPublishScript, {keys_.fence(), keys_.centroids_gen(), keys_.centroids()},
                                          {absl::StrCat(fence), absl::StrCat(generation_floor), std::string(encoded),
                                           keys_.centroids_announce(), std::string(replica_id)}));
  if (reply.type != RedisReply::Type::kArray || reply.elements.size() != 3) return Shape("the publication");
  PublishResult result;
  uint64_t ok = 0;
  if (!ParseU64(reply.elements[0], &ok) || !ParseU64(reply.elements[1], &result.generation) ||
      !ParseU64(reply.elements[2], &result.current_fence)) {
    return Shape("the publication");
  }
  result.fenced = ok != 1;
  return result;
}

absl::StatusOr<uint64_t> ClusterStore::CentroidGeneration() {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply, connection_->Command({"GET", keys_.centroids_gen()}));
  if (reply.is_nil()) return uint64_t{0};
  uint64_t generation = 0;
  if (!ParseU64(reply, &generation)) return Shape("GET centroids:gen");
  return generation;
}

absl::StatusOr<ClusterStore::Generations> ClusterStore::ReadGenerations() {
  ELDR_ASSIGN_OR_RETURN(std::vector<RedisReply> replies,
                        connection_->Pipeline({{"GET", keys_.centroids_gen()}, {"HGET", keys_.centroids(), "gen"}}));
  Generations generations;
  if (!replies[0].is_nil() && !ParseU64(replies[0], &generations.counter)) return Shape("GET centroids:gen");
  if (!replies[1].is_nil() && !ParseU64(replies[1], &generations.stored)) return Shape("HGET centroids gen");
  return generations;
}

absl::StatusOr<uint64_t> ClusterStore::RaiseGenerationFloor(uint64_t floor) {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Eval(kRaiseFloorScript, {keys_.centroids_gen()}, {absl::StrCat(floor)}));
  uint64_t counter = 0;
  if (!ParseU64(reply, &counter)) return Shape("the generation floor");
  return counter;
}

absl::StatusOr<std::optional<StoredCentroids>> ClusterStore::FetchCentroids() {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Command({"HMGET", keys_.centroids(), "gen", "fence", "by", "at_ms", "data"}));
  if (reply.type != RedisReply::Type::kArray || reply.elements.size() != 5) return Shape("HMGET centroids");
  if (reply.elements[0].is_nil() || reply.elements[4].is_nil()) return std::optional<StoredCentroids>();
  StoredCentroids stored;
  int64_t at_ms = 0;
  if (!ParseU64(reply.elements[0], &stored.generation) || !ParseU64(reply.elements[1], &stored.fence) ||
      reply.elements[2].type != RedisReply::Type::kString || reply.elements[3].type != RedisReply::Type::kString ||
      !ParseI64(reply.elements[3].str, &at_ms) || reply.elements[4].type != RedisReply::Type::kString) {
    return Shape("HMGET centroids");
  }
  stored.publisher = std::move(reply.elements[2].str);
  stored.published_at = absl::FromUnixMillis(at_ms);
  stored.data = std::move(reply.elements[4].str);
  return std::optional<StoredCentroids>(std::move(stored));
}

absl::Status ClusterStore::AppendWindow(absl::string_view replica_id, absl::Span<const WindowSignature> entries,
                                        int64_t max_entries) {
  if (entries.empty()) return absl::OkStatus();
  std::vector<std::vector<std::string>> commands;
  commands.reserve(entries.size());
  const std::string key = keys_.window();
  const std::string maxlen = absl::StrCat(std::max<int64_t>(1, max_entries));
  for (const WindowSignature& entry : entries) {
    ELDR_ASSIGN_OR_RETURN(std::string encoded, EncodeWindowSignature(entry));
    commands.push_back({"XADD", key, "MAXLEN", "~", maxlen, "*", "r", std::string(replica_id), "c", entry.client, "e",
                        std::move(encoded)});
  }
  ELDR_ASSIGN_OR_RETURN(std::vector<RedisReply> replies, connection_->Pipeline(commands));
  for (const RedisReply& reply : replies) {
    if (reply.is_error()) {
      return RedisError(RedisErrorKind::kReply, absl::StatusCode::kFailedPrecondition,
                        absl::StrCat("redis XADD: ", reply.str));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<WindowBatch> ClusterStore::ReadWindow(absl::string_view after_id, int64_t max_count) {
  WindowBatch batch;
  batch.last_id = std::string(after_id.empty() ? "0-0" : after_id);
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Command({"XREAD", "COUNT", absl::StrCat(std::max<int64_t>(1, max_count)),
                                              "STREAMS", keys_.window(), batch.last_id}));
  if (reply.is_nil()) return batch;
  if (reply.type != RedisReply::Type::kArray || reply.elements.size() != 1 ||
      reply.elements[0].type != RedisReply::Type::kArray || reply.elements[0].elements.size() != 2 ||
      reply.elements[0].elements[1].type != RedisReply::Type::kArray) {
    return Shape("XREAD");
  }
  for (RedisReply& item : reply.elements[0].elements[1].elements) {
    if (item.type != RedisReply::Type::kArray || item.elements.size() != 2 ||
        item.elements[0].type != RedisReply::Type::kString) {
      return Shape("XREAD (entry)");
    }
    batch.last_id = item.elements[0].str;
    const RedisReply& fields = item.elements[1];
    WindowEntry entry;
    entry.id = item.elements[0].str;
    entry.at = StreamIdTime(entry.id);
    bool have_signature = false;
    std::string client;
    if (fields.type == RedisReply::Type::kArray) {
      for (size_t i = 0; i + 1 < fields.elements.size(); i += 2) {
        const std::string& name = fields.elements[i].str;
        const std::string& value = fields.elements[i + 1].str;
        if (name == "r") {
          entry.replica = value;
        } else if (name == "c") {
          client = value;
        } else if (name == "e") {
          absl::StatusOr<WindowSignature> decoded = DecodeWindowSignature(value);
          if (decoded.ok()) {
            entry.signature = *std::move(decoded);
            have_signature = true;
          }
        }
      }
    }
    if (!have_signature) {
      ++batch.undecodable;
      continue;
    }
    entry.signature.client = std::move(client);
    batch.entries.push_back(std::move(entry));
  }
  return batch;
}

absl::StatusOr<int64_t> ClusterStore::WindowLength() {
  ELDR_ASSIGN_OR_RETURN(RedisReply reply, connection_->Command({"XLEN", keys_.window()}));
  if (reply.type != RedisReply::Type::kInteger) return Shape("XLEN");
  return reply.integer;
}

absl::StatusOr<absl::Time> ClusterStore::PublishLoad(absl::string_view replica_id, const ReplicaLoad& load,
                                                     absl::Duration ttl, absl::Duration stale_after) {
  std::vector<std::string> args;
  args.reserve(7 + 2 * load.workers.size());
  args.push_back(Millis(ttl));
  args.push_back(std::string(replica_id));
  args.push_back(Millis(stale_after));
  args.push_back("#gen");
  args.push_back(absl::StrCat(load.installed_generation));
  args.push_back("#role");
  args.push_back(load.leader ? "leader" : "follower");
  for (const WorkerLeases& worker : load.workers) {
    if (worker.worker_id.empty() || worker.worker_id[0] == '#') continue;  // never a valid worker id
    args.push_back(worker.worker_id);
    args.push_back(absl::StrCat(worker.live, ",", worker.since_snapshot));
  }
  ELDR_ASSIGN_OR_RETURN(RedisReply reply,
                        connection_->Eval(kLoadScript, {keys_.leases(replica_id), keys_.replicas()}, args));
  if (reply.type != RedisReply::Type::kInteger) return Shape("the load publication");
  return absl::FromUnixMillis(reply.integer);
}

absl::StatusOr<std::vector<PeerLoad>> ClusterStore::ReadLoads() {
  ELDR_ASSIGN_OR_RETURN(RedisReply members, connection_->Command({"ZRANGE", keys_.replicas(), "0", "-1"}));
  if (members.type != RedisReply::Type::kArray) return Shape("ZRANGE replicas");
  std::vector<std::string> ids;
  std::vector<std::vector<std::string>> commands;
  for (const RedisReply& member : members.elements) {
    if (member.type != RedisReply::Type::kString || !ValidateReplicaId(member.str).ok()) continue;
    ids.push_back(member.str);
    commands.push_back({"HGETALL", keys_.leases(member.str)});
  }
  std::vector<PeerLoad> peers;
  if (commands.empty()) return peers;
  ELDR_ASSIGN_OR_RETURN(std::vector<RedisReply> hashes, connection_->Pipeline(commands));
  for (size_t i = 0; i < hashes.size(); ++i) {
    const RedisReply& hash = hashes[i];
    if (hash.type != RedisReply::Type::kArray || hash.elements.empty()) continue;  // expired: not counted
    PeerLoad peer;
    peer.replica_id = ids[i];
    for (size_t f = 0; f + 1 < hash.elements.size(); f += 2) {
      const std::string& name = hash.elements[f].str;
      const std::string& value = hash.elements[f + 1].str;
      if (name == "#at") {
        int64_t ms = 0;
        if (ParseI64(value, &ms)) peer.published_at = absl::FromUnixMillis(ms);
      } else if (name == "#gen") {
        if (!absl::SimpleAtoi(value, &peer.load.installed_generation)) peer.load.installed_generation = 0;
      } else if (name == "#role") {
        peer.load.leader = value == "leader";
      } else if (!name.empty() && name[0] != '#') {
        WorkerLeases worker;
        worker.worker_id = name;
        std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(value, absl::MaxSplits(',', 1));
        if (!ParseI64(parts.first, &worker.live)) continue;
        if (parts.second.empty() || !ParseI64(parts.second, &worker.since_snapshot)) worker.since_snapshot = 0;
        peer.load.workers.push_back(std::move(worker));
      }
    }
    peers.push_back(std::move(peer));
  }
  return peers;
}

absl::Status ClusterStore::DeleteLoad(absl::string_view replica_id) {
  ELDR_ASSIGN_OR_RETURN(
      std::vector<RedisReply> replies,
      connection_->Pipeline({{"DEL", keys_.leases(replica_id)}, {"ZREM", keys_.replicas(), std::string(replica_id)}}));
  for (const RedisReply& reply : replies) {
    if (reply.is_error()) {
      return RedisError(RedisErrorKind::kReply, absl::StatusCode::kFailedPrecondition,
                        absl::StrCat("redis: ", reply.str));
    }
  }
  return absl::OkStatus();
}

}  // namespace eldr::cluster
