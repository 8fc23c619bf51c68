// RedisConnection against a real redis-server: commands, pipelines, AUTH and SELECT, the error
// kinds, deadlines on a hung server, reconnection with backoff, EVALSHA falling back to EVAL.
#include "eldr/cluster/redis_connection.h"

#include <fstream>

#include "cluster/redis_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::cluster {
namespace {

using ::testing::HasSubstr;
using testing::RedisServer;

RedisConnectionOptions Fast(const std::string& address) {
  RedisConnectionOptions options;
  options.address = address;
  options.connect_timeout = absl::Milliseconds(300);
  options.command_timeout = absl::Milliseconds(300);
  options.min_backoff = absl::Milliseconds(20);
  options.max_backoff = absl::Milliseconds(200);
  return options;
}

TEST(RedisAddressTest, Parses) {
  EXPECT_EQ(ParseRedisAddress("redis.ns.svc:6380")->port, 6380);
  EXPECT_EQ(ParseRedisAddress("redis")->port, 6379);
  EXPECT_EQ(ParseRedisAddress("[::1]:7000")->host, "::1");
  EXPECT_EQ(ParseRedisAddress("unix:/run/redis.sock")->unix_path, "/run/redis.sock");
  EXPECT_FALSE(ParseRedisAddress("").ok());
  EXPECT_FALSE(ParseRedisAddress("host:0").ok());
  EXPECT_FALSE(ParseRedisAddress("host:99999").ok());
  EXPECT_FALSE(ParseRedisAddress("redis://host").ok());
  EXPECT_FALSE(ParseRedisAddress("unix:relative").ok());
  EXPECT_EQ(RedisAddressString(*ParseRedisAddress("[::1]:7000")), "[::1]:7000");
}

TEST(RedisConnectionTest, CommandsPipelinesAndReplyErrors) {
  auto server = RedisServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto conn = *RedisConnection::Create(Fast((*server)->address()));
  ASSERT_TRUE(conn->Command({"SET", "k", std::string("a\0b", 3)}).ok());
  absl::StatusOr<RedisReply> value = conn->Command({"GET", "k"});
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(value->str, std::string("a\0b", 3));  // binary safe
  EXPECT_TRUE(conn->Command({"GET", "missing"})->is_nil());

  absl::StatusOr<std::vector<RedisReply>> replies =
      conn->Pipeline({{"INCR", "n"}, {"INCR", "n"}, {"LPUSH", "k", "x"}, {"RPUSH", "list", "a", "b"}});
  ASSERT_TRUE(replies.ok()) << replies.status();
  ASSERT_EQ(replies->size(), 4u);
  EXPECT_EQ((*replies)[1].integer, 2);
  EXPECT_TRUE((*replies)[2].is_error());  // WRONGTYPE stays in the vector
  EXPECT_EQ((*replies)[3].integer, 2);

  absl::StatusOr<RedisReply> wrongtype = conn->Command({"LPUSH", "k", "x"});
  EXPECT_EQ(wrongtype.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RedisErrorKindOf(wrongtype.status()), RedisErrorKind::kReply);
  EXPECT_THAT(wrongtype.status().message(), HasSubstr("WRONGTYPE"));
  EXPECT_TRUE(conn->connected());  // an error reply keeps the connection
  EXPECT_GE(conn->Stats().errors[static_cast<int>(RedisErrorKind::kReply)], 2);
}

TEST(RedisConnectionTest, AuthAndSelect) {
  eldr::testing::TempDir dir;
  auto server = RedisServer::Start({"--requirepass", "s3cret"});
  ASSERT_TRUE(server.ok()) << server.status();

  // No password: the first command is refused with NOAUTH.
  auto anonymous = *RedisConnection::Create(Fast((*server)->address()));
  absl::StatusOr<RedisReply> refused = anonymous->Command({"PING"});
  EXPECT_EQ(RedisErrorKindOf(refused.status()), RedisErrorKind::kAuth) << refused.status();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated);

  // Wrong password.
  { std::ofstream(dir.File("wrong")) << "nope\n"; }
  RedisConnectionOptions wrong_options = Fast((*server)->address());
  wrong_options.password_file = dir.File("wrong");
  auto wrong = *RedisConnection::Create(wrong_options);
  absl::StatusOr<RedisReply> denied = wrong->Command({"PING"});
  EXPECT_EQ(RedisErrorKindOf(denied.status()), RedisErrorKind::kAuth) << denied.status();
  EXPECT_FALSE(wrong->connected());
  EXPECT_EQ(wrong->Stats().connect_failures, 1);

  // Missing password file.
  RedisConnectionOptions missing_options = wrong_options;
  missing_options.password_file = dir.File("absent");
  auto missing = *RedisConnection::Create(missing_options);
  EXPECT_EQ(RedisErrorKindOf(missing->Command({"PING"}).status()), RedisErrorKind::kAuth);

  // Right password (with the file's trailing newline), database 3, a client name.
  { std::ofstream(dir.File("right")) << "s3cret\n"; }
  RedisConnectionOptions options = Fast((*server)->address());
  options.password_file = dir.File("right");
  options.db = 3;
  options.client_name = "eldr-test";
  auto conn = *RedisConnection::Create(options);
  ASSERT_TRUE(conn->Command({"SET", "in3", "1"}).ok());
  absl::StatusOr<RedisReply> name = conn->Command({"CLIENT", "GETNAME"});
  ASSERT_TRUE(name.ok());
  EXPECT_EQ(name->str, "eldr-test");
  options.db = 0;
  auto db0 = *RedisConnection::Create(options);
  EXPECT_TRUE(db0->Command({"GET", "in3"})->is_nil());
}

TEST(RedisConnectionTest, UnreachableBacksOffWithoutIo) {
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  RedisConnectionOptions options = Fast(dead->address());
  options.min_backoff = absl::Milliseconds(500);
  options.max_backoff = absl::Seconds(1);
  auto conn = *RedisConnection::Create(options);
  absl::StatusOr<RedisReply> first = conn->Command({"PING"});
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(RedisErrorKindOf(first.status()), RedisErrorKind::kUnreachable);
  // Backing off: refused at once, not counted as another attempt.
  const absl::Time start = absl::Now();
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(conn->Command({"PING"}).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(conn->Stats().connect_failures, 1);
  EXPECT_EQ(conn->Stats().errors[static_cast<int>(RedisErrorKind::kUnreachable)], 1);
}

TEST(RedisConnectionTest, HungServerTimesOutAndRecovers) {
  auto server = RedisServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto conn = *RedisConnection::Create(Fast((*server)->address()));
  ASSERT_TRUE(conn->Command({"PING"}).ok());
  (*server)->Pause();
  const absl::Time start = absl::Now();
  absl::StatusOr<RedisReply> hung = conn->Command({"PING"});
  const absl::Duration took = absl::Now() - start;
  (*server)->Resume();
  EXPECT_EQ(hung.status().code(), absl::StatusCode::kDeadlineExceeded) << hung.status();
  EXPECT_EQ(RedisErrorKindOf(hung.status()), RedisErrorKind::kTimeout);
  EXPECT_GE(took, absl::Milliseconds(290));
  EXPECT_LT(took, absl::Milliseconds(600));
  EXPECT_FALSE(conn->connected());
  // After the backoff the next command reconnects.
  EXPECT_TRUE(testing::WaitFor([&] { return conn->Command({"PING"}).ok(); }, absl::Seconds(2)));
  EXPECT_EQ(conn->Stats().connects, 2);
}

TEST(RedisConnectionTest, ReconnectsAfterRestartAndReloadsScripts) {
  auto server = RedisServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto conn = *RedisConnection::Create(Fast((*server)->address()));
  const RedisScript script("return redis.call('INCRBY', KEYS[1], ARGV[1])");
  absl::StatusOr<RedisReply> first = conn->Eval(script, {"counter"}, {"5"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->integer, 5);
  EXPECT_EQ(conn->Stats().noscript_fallbacks, 0);

  // SCRIPT FLUSH from another client: EVALSHA answers NOSCRIPT, EVAL takes over.
  auto admin = *RedisConnection::Create(Fast((*server)->address()));
  ASSERT_TRUE(admin->Command({"SCRIPT", "FLUSH"}).ok());
  absl::StatusOr<RedisReply> second = conn->Eval(script, {"counter"}, {"1"});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->integer, 6);
  EXPECT_EQ(conn->Stats().noscript_fallbacks, 1);

  // A restart (empty, same port): the command in flight fails as unreachable, a later one works,
  // and the script comes back with it.
  ASSERT_TRUE((*server)->Restart().ok());
  absl::StatusOr<RedisReply> broken = conn->Eval(script, {"counter"}, {"1"});
  EXPECT_FALSE(broken.ok());
  EXPECT_EQ(RedisErrorKindOf(broken.status()), RedisErrorKind::kUnreachable) << broken.status();
  absl::StatusOr<RedisReply> again;
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        again = conn->Eval(script, {"counter"}, {"1"});
        return again.ok();
      },
      absl::Seconds(2)));
  EXPECT_EQ(again->integer, 1);  // the data is gone, the script works
  EXPECT_EQ(conn->Stats().noscript_fallbacks, 2);
}

TEST(RedisConnectionTest, ScriptErrorsAreScriptKind) {
  auto server = RedisServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto conn = *RedisConnection::Create(Fast((*server)->address()));
  const RedisScript bad("return redis.call('NOSUCHCOMMAND')");
  absl::StatusOr<RedisReply> reply = conn->Eval(bad, {}, {});
  EXPECT_EQ(RedisErrorKindOf(reply.status()), RedisErrorKind::kScript) << reply.status();
  const RedisScript syntax("this is not lua");
  EXPECT_FALSE(conn->Eval(syntax, {}, {}).ok());
  EXPECT_TRUE(conn->Command({"PING"}).ok());
}

TEST(RedisConnectionTest, ReadPushDeliversMessages) {
  auto server = RedisServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto sub = *RedisConnection::Create(Fast((*server)->address()));
  auto pub = *RedisConnection::Create(Fast((*server)->address()));
  ASSERT_TRUE(sub->Command({"SUBSCRIBE", "chan"}).ok());
  absl::StatusOr<std::optional<RedisReply>> nothing = sub->ReadPush(absl::Milliseconds(20));
  ASSERT_TRUE(nothing.ok());
  EXPECT_FALSE(nothing->has_value());
  ASSERT_TRUE(pub->Command({"PUBLISH", "chan", "17"}).ok());
  absl::StatusOr<std::optional<RedisReply>> message = sub->ReadPush(absl::Seconds(1));
  ASSERT_TRUE(message.ok() && message->has_value());
  ASSERT_EQ((*message)->elements.size(), 3u);
  EXPECT_EQ((*message)->elements[0].str, "message");
  EXPECT_EQ((*message)->elements[2].str, "17");
}

}  // namespace
}  // namespace eldr::cluster
