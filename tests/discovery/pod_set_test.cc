// The watcher's pure parts: the watch-event state machine (PodSet), PodList pages, the request
// paths and the backoff.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/substitute.h"
#include "eldr/discovery/pod_watcher.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::discovery {
namespace {

using ::testing::HasSubstr;
using Outcome = PodSet::Outcome;

std::string PodJson(const std::string& name, const std::string& rv, const std::string& uid = "", bool ready = true) {
  return absl::Substitute(
      R"({"kind":"Pod","apiVersion":"v1","metadata":{"name":"$0","namespace":"ns","uid":"$2","resourceVersion":"$1"},)"
      R"("spec":{"containers":[{"name":"e","ports":[{"name":"http","containerPort":8000}]}]},)"
      R"("status":{"phase":"Running","podIP":"10.0.0.1","conditions":[{"type":"Ready","status":"$3"}]}})",
      name, rv, uid.empty() ? absl::StrCat("uid-", name) : uid, ready ? "True" : "False");
}

std::string Event(const std::string& type, const std::string& object) {
  return absl::StrCat(R"({"type":")", type, R"(","object":)", object, "}");
}

PodInfo Pod(const std::string& name) {
  PodInfo pod;
  pod.name = name;
  pod.namespace_ = "ns";
  pod.uid = absl::StrCat("uid-", name);
  return pod;
}

std::vector<std::string> Names(const PodSnapshot& snapshot) {
  std::vector<std::string> names;
  for (const PodInfo& pod : snapshot.pods) names.push_back(pod.name);
  return names;
}

TEST(PodSetTest, ReplaceThenEvents) {
  PodSet set;
  set.Replace({Pod("b"), Pod("a")}, "100");
  EXPECT_EQ(set.size(), 2u);
  EXPECT_EQ(set.resource_version(), "100");

  EXPECT_EQ(set.ApplyLine(Event("ADDED", PodJson("c", "101"))).outcome, Outcome::kApplied);
  EXPECT_EQ(set.resource_version(), "101");
  EXPECT_EQ(set.ApplyLine(Event("MODIFIED", PodJson("a", "102", "uid-a", false))).outcome, Outcome::kApplied);
  ASSERT_NE(set.Find("ns", "a"), nullptr);
  EXPECT_FALSE(set.Find("ns", "a")->ready);
  EXPECT_EQ(set.Find("ns", "a")->resource_version, "102");
  EXPECT_EQ(set.ApplyLine(Event("DELETED", PodJson("b", "103"))).outcome, Outcome::kApplied);
  EXPECT_EQ(set.Find("ns", "b"), nullptr);

  const PodSnapshot snapshot = set.Snapshot(absl::UnixEpoch(), /*from_list=*/false);
  EXPECT_EQ(Names(snapshot), (std::vector<std::string>{"a", "c"}));  // sorted
  EXPECT_EQ(snapshot.resource_version, "103");
  EXPECT_FALSE(snapshot.from_list);
}

TEST(PodSetTest, ModifiedOfUnknownPodAddsIt) {
  PodSet set;
  set.Replace({}, "1");
  EXPECT_EQ(set.ApplyLine(Event("MODIFIED", PodJson("x", "2"))).outcome, Outcome::kApplied);
  EXPECT_NE(set.Find("ns", "x"), nullptr);
  // A DELETED of a pod never seen is harmless.
  EXPECT_EQ(set.ApplyLine(Event("DELETED", PodJson("y", "3"))).outcome, Outcome::kApplied);
  EXPECT_EQ(set.size(), 1u);
  EXPECT_EQ(set.resource_version(), "3");
}

TEST(PodSetTest, LateDeleteOfAReplacedPodKeepsTheNewOne) {
  PodSet set;
  set.Replace({}, "1");
  set.ApplyLine(Event("ADDED", PodJson("p", "2", "new-uid")));
  EXPECT_EQ(set.ApplyLine(Event("DELETED", PodJson("p", "3", "old-uid"))).outcome, Outcome::kApplied);
  ASSERT_NE(set.Find("ns", "p"), nullptr);
  EXPECT_EQ(set.Find("ns", "p")->uid, "new-uid");
  EXPECT_EQ(set.ApplyLine(Event("DELETED", PodJson("p", "4", "new-uid"))).outcome, Outcome::kApplied);
  EXPECT_EQ(set.Find("ns", "p"), nullptr);
}

TEST(PodSetTest, BookmarkOnlyAdvancesTheVersion) {
  PodSet set;
  set.Replace({Pod("a")}, "10");
  auto result =
      set.ApplyLine(R"({"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1",)"
                    R"("metadata":{"resourceVersion":"55","annotations":{"k8s.io/initial-events-end":"true"}}}})");
  EXPECT_EQ(result.outcome, Outcome::kBookmark);
  EXPECT_EQ(set.resource_version(), "55");
  EXPECT_EQ(set.size(), 1u);
  EXPECT_EQ(set.ApplyLine(R"({"type":"BOOKMARK","object":{"metadata":{}}})").outcome, Outcome::kInvalid);
  EXPECT_EQ(
      set.ApplyLine(R"({"type":"BOOKMARK","object":{"kind":"Node","metadata":{"resourceVersion":"56"}}})").outcome,
      Outcome::kInvalid);
  EXPECT_EQ(set.resource_version(), "55");
}

TEST(PodSetTest, ErrorEvents) {
  PodSet set;
  set.Replace({Pod("a")}, "10");
  auto gone =
      set.ApplyLine(R"({"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",)"
                    R"("message":"too old resource version: 10 [200]","reason":"Expired","code":410}})");
  EXPECT_EQ(gone.outcome, Outcome::kGone);
  EXPECT_TRUE(IsGone(gone.status));
  EXPECT_THAT(gone.status.message(), HasSubstr("too old resource version"));
  auto other = set.ApplyLine(R"({"type":"ERROR","object":{"kind":"Status","message":"boom","code":500}})");
  EXPECT_EQ(other.outcome, Outcome::kError);
  EXPECT_EQ(other.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(other.status.message(), HasSubstr("boom"));
  auto no_code = set.ApplyLine(R"({"type":"ERROR","object":{"message":"?"}})");
  EXPECT_EQ(no_code.outcome, Outcome::kError);
  EXPECT_EQ(set.resource_version(), "10");
  EXPECT_EQ(set.size(), 1u);
}

TEST(PodSetTest, GarbageChangesNothing) {
  PodSet set;
  set.Replace({Pod("a")}, "10");
  const std::vector<std::string> garbage = {
      "this is not JSON {\"type\": ",
      "",
      "[]",
      "\"ADDED\"",
      R"({"object":{}})",
      R"({"type":7,"object":{}})",
      R"({"type":"ADDED"})",
      R"({"type":"ADDED","object":"pod"})",
      R"({"type":"ADDED","object":{"kind":"Service","metadata":{"name":"s","resourceVersion":"11"}}})",
      R"({"type":"ADDED","object":{"metadata":{"name":"x"}}})",  // no resourceVersion
      R"({"type":"ADDED","object":{"metadata":{"name":"x","resourceVersion":"11","labels":{"a":1}}}})",
      R"({"type":"DELETED","object":{"metadata":{"name":"a","resourceVersion":11}}})",
      R"({"type":"RESIZED","object":{"metadata":{"name":"a","resourceVersion":"11"}}})",
      Event("ADDED", PodJson("b", "11")).substr(0, 40),  // truncated
  };
  for (const std::string& line : garbage) {
    auto result = set.ApplyLine(line);
    EXPECT_EQ(result.outcome, Outcome::kInvalid) << line;
    EXPECT_EQ(result.status.code(), absl::StatusCode::kInvalidArgument) << line;
  }
  EXPECT_EQ(set.resource_version(), "10");
  ASSERT_EQ(set.size(), 1u);
  EXPECT_NE(set.Find("ns", "a"), nullptr);
}

TEST(ParsePodListTest, Pages) {
  auto page = ParsePodList(absl::StrCat(
      R"({"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"500","continue":"tok","remainingItemCount":3},"items":[)",
      PodJson("a", "1"), ",", PodJson("b", "2"), "]}"));
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->pods.size(), 2u);
  EXPECT_EQ(page->resource_version, "500");
  EXPECT_EQ(page->continue_token, "tok");
  auto last = ParsePodList(R"({"kind":"PodList","metadata":{"resourceVersion":"7"},"items":[]})");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->pods.empty());
  EXPECT_TRUE(last->continue_token.empty());
}

TEST(ParsePodListTest, GarbageIsRefused) {
  const std::string full =
      absl::StrCat(R"({"kind":"PodList","metadata":{"resourceVersion":"5"},"items":[)", PodJson("a", "1"), "]}");
  const std::vector<std::string> garbage = {
      "<html><body>this is not JSON</body></html>",
      full.substr(0, full.size() / 2),
      "[]",
      R"({"kind":"PodList","metadata":{"resourceVersion":"5"}})",  // no items: not "empty"
      R"({"kind":"PodList","metadata":{"resourceVersion":"5"},"items":null})",
      R"({"kind":"PodList","metadata":{"resourceVersion":"5"},"items":{}})",
      R"({"kind":"PodList","items":[]})",  // no version
      R"({"kind":"PodList","metadata":{"resourceVersion":""},"items":[]})",
      R"({"kind":"PodList","metadata":{"resourceVersion":5},"items":[]})",
      R"({"kind":"ServiceList","metadata":{"resourceVersion":"5"},"items":[]})",
      R"({"kind":"Status","status":"Failure","code":500})",
      R"({"kind":"PodList","metadata":{"resourceVersion":"5","continue":1},"items":[]})",
      R"({"kind":"PodList","metadata":{"resourceVersion":"5"},"items":[{"metadata":{"name":"ok"}},7]})",
  };
  for (const std::string& body : garbage) {
    EXPECT_EQ(ParsePodList(body).status().code(), absl::StatusCode::kInvalidArgument) << body;
  }
}

TEST(PodPathsTest, ListAndWatch) {
  PodWatcherOptions options;
  options.namespace_ = "inference";
  options.label_selector = "app=decode,tier in (a,b)";
  options.list_page_size = 250;
  EXPECT_EQ(PodListPath(options, ""),
            "/api/v1/namespaces/inference/pods?limit=250&labelSelector=app%3Ddecode%2Ctier%20in%20%28a%2Cb%29");
  EXPECT_EQ(PodListPath(options, "a+b/c="),
            "/api/v1/namespaces/inference/pods?limit=250&labelSelector=app%3Ddecode%2Ctier%20in%20%28a%2Cb%29"
            "&continue=a%2Bb%2Fc%3D");
  options.field_selector = "status.phase=Running";
  EXPECT_EQ(PodWatchPath(options, "12345", 300),
            "/api/v1/namespaces/inference/pods?watch=1&resourceVersion=12345&allowWatchBookmarks=true"
            "&timeoutSeconds=300&labelSelector=app%3Ddecode%2Ctier%20in%20%28a%2Cb%29"
            "&fieldSelector=status.phase%3DRunning");
  options.namespace_.clear();
  options.label_selector.clear();
  options.field_selector.clear();
  options.allow_bookmarks = false;
  EXPECT_EQ(PodWatchPath(options, "9", 60), "/api/v1/pods?watch=1&resourceVersion=9&timeoutSeconds=60");
}

TEST(BackoffTest, FullJitterUnderAGrowingCap) {
  BackoffOptions options;
  options.initial = absl::Milliseconds(200);
  options.max = absl::Seconds(30);
  options.factor = 2;
  Backoff backoff(options, /*seed=*/42);
  absl::Duration cap = absl::Milliseconds(200);
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(backoff.NextCap(), std::min(cap, absl::Seconds(30))) << i;
    const absl::Duration delay = backoff.Next();
    EXPECT_GE(delay, absl::ZeroDuration());
    EXPECT_LE(delay, std::min(cap, absl::Seconds(30)));
    cap *= 2;
  }
  EXPECT_EQ(backoff.NextCap(), absl::Seconds(30));
  backoff.Reset();
  EXPECT_EQ(backoff.NextCap(), absl::Milliseconds(200));
  // Jittered: not all the same.
  Backoff spread(options, 7);
  absl::Duration first = spread.Next();
  spread.Reset();
  bool differs = false;
  for (int i = 0; i < 10 && !differs; ++i) {
    differs = spread.Next() != first;
    spread.Reset();
  }
  EXPECT_TRUE(differs);
}

TEST(PodWatcherOptionsTest, Validation) {
  EXPECT_TRUE(ValidatePodWatcherOptions(PodWatcherOptions()).ok());
  PodWatcherOptions options;
  options.list_page_size = 0;
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
  options = {};
  options.watch_timeout = absl::Milliseconds(500);
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
  options = {};
  options.watch_timeout_jitter = 1;
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
  options = {};
  options.silence_timeout = absl::ZeroDuration();
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
  options = {};
  options.backoff.max = absl::Milliseconds(1);
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
  options = {};
  options.backoff.factor = 0.5;
  EXPECT_FALSE(ValidatePodWatcherOptions(options).ok());
}

TEST(KubeHttpStatusTest, Mapping) {
  const std::string body =
      R"({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"pods is forbidden: User \"x\" cannot list","reason":"Forbidden","code":403})";
  absl::Status status = KubeHttpStatus(403, body);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(status.message(), "HTTP 403: pods is forbidden: User \"x\" cannot list");
  EXPECT_EQ(HttpStatusOf(status), 403);
  EXPECT_EQ(KubeHttpStatus(401, "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(KubeHttpStatus(404, "").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(IsGone(KubeHttpStatus(410, "")));
  EXPECT_EQ(KubeHttpStatus(429, "").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(KubeHttpStatus(503, "<html>busy</html>").code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(KubeHttpStatus(503, "<html>busy</html>").message(), HasSubstr("<html>busy"));
  EXPECT_EQ(KubeHttpStatus(400, "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KubeHttpStatus(418, "").code(), absl::StatusCode::kUnknown);
  EXPECT_TRUE(KubeHttpStatus(200, "").ok());
  EXPECT_EQ(HttpStatusOf(absl::UnavailableError("refused")), std::nullopt);
}

TEST(UrlEncodeTest, Reserved) {
  EXPECT_EQ(UrlEncode("a-b_c.d~e"), "a-b_c.d~e");
  EXPECT_EQ(UrlEncode("app=x,y!=z"), "app%3Dx%2Cy%21%3Dz");
  EXPECT_EQ(UrlEncode(std::string("\xff\x01", 2)), "%FF%01");
}

}  // namespace
}  // namespace eldr::discovery
