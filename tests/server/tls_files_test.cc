#include "server/tls_files.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "openssl/err.h"
#include "testing/process.h"

extern char** environ;

namespace eldr::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Replaces `path` atomically (temp file + rename), as a careful operator or the kubelet would.
void WriteAtomically(const std::string& path, const std::string& bytes) {
  const std::string temp = path + ".writing";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << bytes;
    ASSERT_TRUE(out.good()) << temp;
  }
  ASSERT_EQ(std::rename(temp.c_str(), path.c_str()), 0) << path;
}

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

std::time_t MtimeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mtime;
}

using ScratchDir = ::eldr::testing::TempDir;

// Writes `text` to the file `name` in `dir` and returns its path.
std::string WriteScratch(const ScratchDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.File(name);
  std::ofstream(path) << text;
  return path;
}

// Runs `openssl args...`, output appended to `log`; the log's content explains a failure.
absl::Status RunOpenssl(const std::string& log, const std::vector<std::string>& args) {
  std::vector<std::string> argv_strings = {"openssl"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_strings) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, "openssl", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return absl::InternalError(absl::StrCat("cannot run openssl: ", std::strerror(spawned)));
  int wait_status = 0;
  while (::waitpid(pid, &wait_status, 0) < 0) {
    if (errno != EINTR) return absl::InternalError("waitpid failed");
  }
  if (!WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0) {
    return absl::InternalError(
        absl::StrCat("openssl ", absl::StrJoin(args, " "), " failed; output so far:\n", ReadAll(log)));
  }
  return absl::OkStatus();
}

// A key and certificate made by the openssl CLI.
struct Pair {
  std::string cert;
  std::string key;
};

// Every key and certificate the tests use, made once per test binary run (RSA keys take a while).
class Material {
 public:
  static const Material& Get() {
    static const Material material;
    return material;
  }

  std::string File(const std::string& name) const { return dir_.File(name); }

  Pair ca;                       // self-signed, EC P-256, CN=tls-test-ca
  Pair ec;                       // EC P-256 leaf signed by ca, CN=leaf-ec
  Pair ec_other;                 // another EC leaf, CN=leaf-ec-other
  Pair rsa;                      // RSA 2048 leaf, CN=leaf-rsa
  Pair ed25519;                  // Ed25519 leaf, CN=leaf-ed25519
  Pair expired;                  // EC leaf valid 2020-01-01 .. 2020-02-01, CN=leaf-expired
  Pair not_yet;                  // EC leaf valid from 2090-01-01
  std::string ec_chain;          // ec's certificate followed by ca's
  std::string other_ca;          // an unrelated self-signed CA certificate
  std::string ca_bundle;         // ca + other_ca
  std::string encrypted_pkcs8;   // ec's key, PKCS#8 encrypted
  std::string encrypted_legacy;  // rsa's key, traditional PEM with Proc-Type: 4,ENCRYPTED
  std::string der_cert;          // ec's certificate in DER
  std::string rsa_traditional;   // rsa's key as "BEGIN RSA PRIVATE KEY"

 private:
  Material() { Make(); }

  void Run(const std::vector<std::string>& args) {
    const absl::Status status = RunOpenssl(dir_.File("openssl.log"), args);
    if (!status.ok()) {
      ADD_FAILURE() << status;
      std::abort();  // every test needs this material
    }
  }

  std::vector<std::string> NewKey(const std::string& type) {
    if (type == "rsa") return {"-newkey", "rsa:2048"};
    if (type == "ed25519") return {"-newkey", "ed25519"};
    return {"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"};
  }

  // A key and CSR named `name`.
  void Request(const std::string& name, const std::string& type, const std::string& cn) {
    std::vector<std::string> args = {"req", "-new"};
    for (const std::string& arg : NewKey(type)) args.push_back(arg);
    for (const std::string& arg : {std::string("-nodes"), std::string("-keyout"), File(name + ".key"),
                                   std::string("-out"), File(name + ".csr"), std::string("-subj"), "/CN=" + cn}) {
      args.push_back(arg);
    }
    Run(args);
  }

  Pair Leaf(const std::string& name, const std::string& type, const std::string& cn) {
    Request(name, type, cn);
    Run({"x509", "-req", "-in", File(name + ".csr"), "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial", "-out",
         File(name + ".crt"), "-days", "2"});
    return {File(name + ".crt"), File(name + ".key")};
  }

  // A leaf with the given validity dates (YYYYMMDDHHMMSSZ): `openssl x509` of OpenSSL 3.0 can only
  // start a certificate now, `openssl ca` takes both dates.
  Pair LeafWithDates(const std::string& name, const std::string& start, const std::string& end) {
    Request(name, "ec", "leaf-" + name);
    const std::string db = File(name + "-ca");
    std::filesystem::create_directories(db);
    std::ofstream(db + "/index.txt").close();
    std::ofstream(db + "/serial") << "1000\n";
    std::ofstream(db + "/ca.cnf") << "[ca]\ndefault_ca = test_ca\n[test_ca]\ndatabase = " << db
                                  << "/index.txt\nnew_certs_dir = " << db << "\nserial = " << db
                                  << "/serial\ndefault_md = sha256\npolicy = any\nunique_subject = no\n"
                                     "[any]\ncommonName = supplied\n";
    Run({"ca", "-batch", "-config", db + "/ca.cnf", "-cert", ca.cert, "-keyfile", ca.key, "-in", File(name + ".csr"),
         "-startdate", start, "-enddate", end, "-notext", "-out", File(name + ".crt")});
    return {File(name + ".crt"), File(name + ".key")};
  }

  void Make() {
    ca = {File("ca.crt"), File("ca.key")};
    Run({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", ca.key,
         "-out", ca.cert, "-days", "2", "-subj", "/CN=tls-test-ca"});
    ec = Leaf("ec", "ec", "leaf-ec");
    ec_other = Leaf("ec_other", "ec", "leaf-ec-other");
    rsa = Leaf("rsa", "rsa", "leaf-rsa");
    ed25519 = Leaf("ed25519", "ed25519", "leaf-ed25519");
    expired = LeafWithDates("expired", "20200101000000Z", "20200201000000Z");
    not_yet = LeafWithDates("not_yet", "20900101000000Z", "20910101000000Z");

    ec_chain = File("ec_chain.crt");
    std::ofstream(ec_chain) << ReadAll(ec.cert) << ReadAll(ca.cert);
    other_ca = File("other_ca.crt");
    Run({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
         File("other_ca.key"), "-out", other_ca, "-days", "2", "-subj", "/CN=tls-test-other-ca"});
    ca_bundle = File("ca_bundle.crt");
    std::ofstream(ca_bundle) << "# client CAs\n" << ReadAll(ca.cert) << "\n" << ReadAll(other_ca);

    encrypted_pkcs8 = File("encrypted_pkcs8.key");
    Run({"pkcs8", "-topk8", "-in", ec.key, "-out", encrypted_pkcs8, "-v2", "aes-256-cbc", "-passout", "pass:secret"});
    encrypted_legacy = File("encrypted_legacy.key");
    Run({"rsa", "-in", rsa.key, "-out", encrypted_legacy, "-aes256", "-traditional", "-passout", "pass:secret"});
    rsa_traditional = File("rsa_traditional.key");
    Run({"rsa", "-in", rsa.key, "-out", rsa_traditional, "-traditional"});
    der_cert = File("ec.der");
    Run({"x509", "-in", ec.cert, "-outform", "der", "-out", der_cert});
  }

  ScratchDir dir_;
};

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// The base64 lines of a PEM key: none of them may ever appear in an error message.
std::vector<std::string> KeyBodyLines(const std::string& key_path) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(ReadAll(key_path), '\n')) {
    if (line.size() >= 16 && !absl::StartsWith(line, "-----") && line.find(':') == absl::string_view::npos) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

// ---- ValidateTlsFiles ----

TEST(TlsValidate, AcceptsEcRsaAndEd25519Pairs) {
  const Material& m = Material::Get();
  EXPECT_TRUE(ValidateTlsFiles({m.ec.cert, m.ec.key, ""}).ok()) << ValidateTlsFiles({m.ec.cert, m.ec.key, ""});
  EXPECT_TRUE(ValidateTlsFiles({m.rsa.cert, m.rsa.key, ""}).ok()) << ValidateTlsFiles({m.rsa.cert, m.rsa.key, ""});
  EXPECT_TRUE(ValidateTlsFiles({m.ed25519.cert, m.ed25519.key, ""}).ok())
      << ValidateTlsFiles({m.ed25519.cert, m.ed25519.key, ""});
}

TEST(TlsValidate, AcceptsAChainFileAndASelfSignedPair) {
  const Material& m = Material::Get();
  EXPECT_TRUE(ValidateTlsFiles({m.ec_chain, m.ec.key, ""}).ok()) << ValidateTlsFiles({m.ec_chain, m.ec.key, ""});
  EXPECT_TRUE(ValidateTlsFiles({m.ca.cert, m.ca.key, ""}).ok());
}

TEST(TlsValidate, AcceptsTraditionalKeysAndOneFileHoldingCertificateAndKey) {
  const Material& m = Material::Get();
  EXPECT_TRUE(ValidateTlsFiles({m.rsa.cert, m.rsa_traditional, ""}).ok())
      << ValidateTlsFiles({m.rsa.cert, m.rsa_traditional, ""});
  ScratchDir dir;
  const std::string combined = dir.File("combined.pem");  // what gRPC accepts for both settings
  std::ofstream(combined) << ReadAll(m.ec.key) << ReadAll(m.ec.cert) << ReadAll(m.ca.cert);
  EXPECT_TRUE(ValidateTlsFiles({combined, combined, ""}).ok()) << ValidateTlsFiles({combined, combined, ""});
}

TEST(TlsValidate, MismatchedKeyNamesTlsKeyTheFilesAndTheSubject) {
  const Material& m = Material::Get();
  const absl::Status status = ValidateTlsFiles({m.ec.cert, m.ec_other.key, ""});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("setting 'tls_key': the private key in '" + m.ec_other.key +
                                               "' does not match the certificate in 'tls_cert'"),
                                     HasSubstr(m.ec.cert), HasSubstr("CN=leaf-ec")));
  // The key of the chain's second certificate (the CA) is not the leaf's key either.
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec_chain, m.ca.key, ""})), HasSubstr("does not match"));
}

TEST(TlsValidate, MismatchedKeyTypesAreNamed) {
  const Material& m = Material::Get();
  const absl::Status status = ValidateTlsFiles({m.ec.cert, m.rsa.key, ""});
  EXPECT_THAT(Message(status), AllOf(HasSubstr("setting 'tls_key'"), HasSubstr("does not match"),
                                     HasSubstr("the key is RSA, the certificate's key is EC")));
}

TEST(TlsValidate, GarbageEmptyAndNonPemCertificatesAreRefused) {
  const Material& m = Material::Get();
  ScratchDir dir;
  const std::string garbage = WriteScratch(dir, "garbage", "this is not a certificate\n");
  const std::string empty = WriteScratch(dir, "empty", "");
  const std::string cert_text = ReadAll(m.ec.cert);
  const std::string truncated = WriteScratch(dir, "truncated.crt", cert_text.substr(0, cert_text.size() / 2));
  const std::string bad_base64 = WriteScratch(
      dir, "bad_base64.crt", "-----BEGIN CERTIFICATE-----\n!!!! not base64 !!!!\n-----END CERTIFICATE-----\n");
  const std::string not_x509 =
      WriteScratch(dir, "not_x509.crt", "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n");
  const std::string bad_second = WriteScratch(
      dir, "bad_second.crt", cert_text + "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n");

  EXPECT_THAT(Message(ValidateTlsFiles({garbage, m.ec.key, ""})),
              HasSubstr("setting 'tls_cert': '" + garbage + "' holds no PEM certificate"));
  EXPECT_THAT(Message(ValidateTlsFiles({empty, m.ec.key, ""})),
              HasSubstr("setting 'tls_cert': '" + empty + "' is empty"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.der_cert, m.ec.key, ""})), HasSubstr("it looks like DER"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.key, m.ec.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert'"), HasSubstr("holds no PEM certificate"), HasSubstr("PRIVATE KEY")));
  EXPECT_THAT(Message(ValidateTlsFiles({truncated, m.ec.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert'"), HasSubstr("PEM block 1 is malformed")));
  EXPECT_THAT(Message(ValidateTlsFiles({bad_base64, m.ec.key, ""})), HasSubstr("PEM block 1 is malformed"));
  EXPECT_THAT(Message(ValidateTlsFiles({not_x509, m.ec.key, ""})),
              HasSubstr("certificate 1 (PEM block 1) is not a valid X.509 certificate"));
  EXPECT_THAT(Message(ValidateTlsFiles({bad_second, m.ec.key, ""})),
              HasSubstr("certificate 2 (PEM block 2) is not a valid X.509 certificate"));
  EXPECT_THAT(Message(ValidateTlsFiles({"", m.ec.key, ""})), HasSubstr("setting 'tls_cert': no file given"));
}

TEST(TlsValidate, GarbageEmptyAndNonPemKeysAreRefused) {
  const Material& m = Material::Get();
  ScratchDir dir;
  const std::string garbage = WriteScratch(dir, "garbage", "this is not a key\n");
  const std::string empty = WriteScratch(dir, "empty", "");
  const std::string corrupt =
      WriteScratch(dir, "corrupt.key", "-----BEGIN PRIVATE KEY-----\nAAAAAAAA\n-----END PRIVATE KEY-----\n");

  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, garbage, ""})),
              HasSubstr("setting 'tls_key': '" + garbage + "' holds no PEM block"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, empty, ""})),
              HasSubstr("setting 'tls_key': '" + empty + "' is empty"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.cert, ""})),
              AllOf(HasSubstr("setting 'tls_key'"), HasSubstr("holds no private key OpenSSL can read"),
                    HasSubstr("its PEM blocks: CERTIFICATE")));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, corrupt, ""})),
              AllOf(HasSubstr("setting 'tls_key'"), HasSubstr("holds no private key OpenSSL can read")));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, "", ""})), HasSubstr("setting 'tls_key': no file given"));
}

TEST(TlsValidate, DirectoriesDevicesFifosAndMissingFilesAreRefusedWithoutReading) {
  const Material& m = Material::Get();
  ScratchDir dir;
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Each of these would block or never end if it were read.
  EXPECT_THAT(Message(ValidateTlsFiles({dir.path(), m.ec.key, ""})),
              HasSubstr("setting 'tls_cert': '" + dir.path() + "' is a directory, not a regular file"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, "/dev/zero", ""})),
              HasSubstr("setting 'tls_key': '/dev/zero' is a character device, not a regular file"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.key, fifo})),
              HasSubstr("setting 'tls_client_ca': '" + fifo + "' is a FIFO, not a regular file"));
  EXPECT_THAT(Message(ValidateTlsFiles({dir.File("missing.crt"), m.ec.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert': cannot read '" + dir.File("missing.crt") + "'"),
                    HasSubstr("No such file or directory")));
}

TEST(TlsValidate, FilesOverTheSizeLimitAreRefused) {
  const Material& m = Material::Get();
  ScratchDir dir;
  const std::string big = dir.File("big.crt");
  {
    std::ofstream out(big, std::ios::binary);
    out << ReadAll(m.ec.cert) << std::string(kMaxTlsFileBytes, '#');
  }
  EXPECT_THAT(Message(ValidateTlsFiles({big, m.ec.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert'"), HasSubstr("over the limit of 1048576 bytes")));
}

TEST(TlsValidate, EncryptedKeysAreRefusedAndSaySo) {
  const Material& m = Material::Get();
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.encrypted_pkcs8, ""})),
              HasSubstr("setting 'tls_key': '" + m.encrypted_pkcs8 + "' holds an encrypted private key"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.rsa.cert, m.encrypted_legacy, ""})),
              HasSubstr("setting 'tls_key': '" + m.encrypted_legacy + "' holds an encrypted private key"));
}

TEST(TlsValidate, ExpiredAndNotYetValidCertificatesAreRefused) {
  const Material& m = Material::Get();
  EXPECT_THAT(Message(ValidateTlsFiles({m.expired.cert, m.expired.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert': the certificate in '" + m.expired.cert + "'"),
                    HasSubstr("CN=leaf-expired"), HasSubstr("expired at 2020-02-01T00:00:00Z")));
  EXPECT_THAT(Message(ValidateTlsFiles({m.not_yet.cert, m.not_yet.key, ""})),
              AllOf(HasSubstr("setting 'tls_cert'"), HasSubstr("is not valid before 2090-01-01T00:00:00Z")));
}

TEST(TlsValidate, ClientCaBundles) {
  const Material& m = Material::Get();
  EXPECT_TRUE(ValidateTlsFiles({m.ec.cert, m.ec.key, m.ca.cert}).ok());
  EXPECT_TRUE(ValidateTlsFiles({m.ec.cert, m.ec.key, m.ca_bundle}).ok())
      << ValidateTlsFiles({m.ec.cert, m.ec.key, m.ca_bundle});
  ScratchDir dir;
  const std::string garbage = dir.File("garbage");
  std::ofstream(garbage) << "no CA here\n";
  const std::string corrupt = dir.File("corrupt.crt");
  std::ofstream(corrupt) << ReadAll(m.ca.cert) << "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.key, garbage})),
              HasSubstr("setting 'tls_client_ca': '" + garbage + "' holds no PEM certificate"));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.key, m.ca.key})),
              AllOf(HasSubstr("setting 'tls_client_ca'"), HasSubstr("holds no PEM certificate")));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.key, corrupt})),
              AllOf(HasSubstr("setting 'tls_client_ca'"), HasSubstr("certificate 2 (PEM block 2)")));
  EXPECT_THAT(Message(ValidateTlsFiles({m.ec.cert, m.ec.key, dir.File("missing")})),
              HasSubstr("setting 'tls_client_ca': cannot read"));
}

TEST(TlsValidate, MessagesCarryNoKeyMaterialAndLeaveNoOpenSslErrors) {
  const Material& m = Material::Get();
  std::vector<absl::Status> failures = {
      ValidateTlsFiles({m.ec.cert, m.ec_other.key, ""}),
      ValidateTlsFiles({m.ec.cert, m.rsa.key, ""}),
      ValidateTlsFiles({m.ec.key, m.ec.key, ""}),
      ValidateTlsFiles({m.ec.cert, m.encrypted_pkcs8, ""}),
      ValidateTlsFiles({m.ec.cert, m.ec.key, m.ec_other.key}),
      ValidateTlsFiles({m.ec.cert, m.ca.cert, ""}),
  };
  std::vector<std::string> secrets;
  for (const std::string& key : {m.ec.key, m.ec_other.key, m.rsa.key, m.encrypted_pkcs8}) {
    for (std::string& line : KeyBodyLines(key)) secrets.push_back(std::move(line));
  }
  ASSERT_FALSE(secrets.empty());
  for (const absl::Status& status : failures) {
    ASSERT_FALSE(status.ok());
    for (const std::string& secret : secrets) EXPECT_THAT(Message(status), Not(HasSubstr(secret.substr(0, 16))));
  }
  EXPECT_EQ(ERR_peek_error(), 0u) << "ValidateTlsFiles left errors on the OpenSSL queue";
  EXPECT_TRUE(ValidateTlsFiles({m.ec.cert, m.ec.key, ""}).ok());
  EXPECT_EQ(ERR_peek_error(), 0u);
}

// ---- TlsFileMirror ----

// Source files an operator could rotate, initially the EC pair.
struct Sources {
  explicit Sources(const ScratchDir& dir, bool with_client_ca = false)
      : files{dir.File("server.crt"), dir.File("server.key"), with_client_ca ? dir.File("client_ca.crt") : ""} {
    Install(Material::Get().ec);
    if (with_client_ca) WriteAtomically(files.client_ca, ReadAll(Material::Get().ca.cert));
  }
  void Install(const Pair& pair) const {
    WriteAtomically(files.cert, ReadAll(pair.cert));
    WriteAtomically(files.key, ReadAll(pair.key));
  }
  TlsFiles files;
};

void ExpectMirrorHolds(const TlsFileMirror& mirror, const Pair& pair) {
  EXPECT_EQ(ReadAll(mirror.mirrored().cert), ReadAll(pair.cert));
  EXPECT_EQ(ReadAll(mirror.mirrored().key), ReadAll(pair.key));
}

TEST(TlsMirror, CreateCopiesTheValidatedSetPrivately) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  const std::string mirror_dir = dir.File("run/tls-mirror");  // parent "run" is missing too
  auto mirror = TlsFileMirror::Create(sources.files, mirror_dir);
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  const TlsFiles mirrored = (*mirror)->mirrored();
  EXPECT_EQ(mirrored.cert, mirror_dir + "/tls_cert.pem");
  EXPECT_EQ(mirrored.key, mirror_dir + "/tls_key.pem");
  EXPECT_EQ(mirrored.client_ca, "");
  EXPECT_EQ((*mirror)->generation(), 1u);
  ExpectMirrorHolds(**mirror, m.ec);
  EXPECT_EQ(ModeOf(mirror_dir), 0700u);
  EXPECT_EQ(ModeOf(mirrored.cert), 0600u);
  EXPECT_EQ(ModeOf(mirrored.key), 0600u);
  EXPECT_EQ(ModeOf(mirror_dir + "/current"), 0700u);
  EXPECT_TRUE(ValidateTlsFiles(mirrored).ok());
  EXPECT_EQ((*mirror)->source().key, sources.files.key);
}

TEST(TlsMirror, CreateRefusesAnInvalidSetAndWritesNothing) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  WriteAtomically(sources.files.key, ReadAll(m.ec_other.key));
  const std::string mirror_dir = dir.File("mirror");
  auto mirror = TlsFileMirror::Create(sources.files, mirror_dir);
  ASSERT_FALSE(mirror.ok());
  EXPECT_EQ(mirror.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(mirror.status()), AllOf(HasSubstr("setting 'tls_key'"), HasSubstr("does not match")));
  EXPECT_FALSE(std::filesystem::exists(mirror_dir));
  EXPECT_FALSE(TlsFileMirror::Create(sources.files, "").ok());
}

TEST(TlsMirror, RefreshOfUnchangedFilesReturnsFalse) {
  ScratchDir dir;
  Sources sources(dir, /*with_client_ca=*/true);
  auto mirror = TlsFileMirror::Create(sources.files, dir.File("mirror"));
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  const std::time_t mtime = MtimeOf((*mirror)->mirrored().key);
  for (int i = 0; i < 3; ++i) {
    auto changed = (*mirror)->Refresh();
    ASSERT_TRUE(changed.ok()) << changed.status();
    EXPECT_FALSE(*changed);
  }
  // Rewriting the same bytes (a new inode and modification time) is no change either.
  sources.Install(Material::Get().ec);
  auto changed = (*mirror)->Refresh();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(*changed);
  EXPECT_EQ((*mirror)->generation(), 1u);
  EXPECT_EQ(MtimeOf((*mirror)->mirrored().key), mtime);
}

TEST(TlsMirror, RotationInstallsValidSetsAndRefusesBrokenOnes) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  auto created = TlsFileMirror::Create(sources.files, dir.File("mirror"));
  ASSERT_TRUE(created.ok()) << created.status();
  TlsFileMirror& mirror = **created;
  const std::time_t first_mtime = MtimeOf(mirror.mirrored().key);

  // A valid new pair (another key type even) is installed.
  sources.Install(m.rsa);
  auto changed = mirror.Refresh();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(mirror.generation(), 2u);
  ExpectMirrorHolds(mirror, m.rsa);
  const std::time_t second_mtime = MtimeOf(mirror.mirrored().key);
  EXPECT_GT(second_mtime, first_mtime);
  EXPECT_EQ(MtimeOf(mirror.mirrored().cert), second_mtime);

  // A half-done rotation (new key, old certificate) is refused; the copies stay byte for byte.
  const std::string cert_before = ReadAll(mirror.mirrored().cert);
  const std::string key_before = ReadAll(mirror.mirrored().key);
  WriteAtomically(sources.files.key, ReadAll(m.ec_other.key));
  for (int i = 0; i < 2; ++i) {  // refused again on every call while the source stays broken
    auto refused = mirror.Refresh();
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(refused.status()),
                AllOf(HasSubstr("setting 'tls_key'"), HasSubstr("does not match"), HasSubstr("CN=leaf-rsa")));
  }
  EXPECT_EQ(ReadAll(mirror.mirrored().cert), cert_before);
  EXPECT_EQ(ReadAll(mirror.mirrored().key), key_before);
  EXPECT_EQ(MtimeOf(mirror.mirrored().key), second_mtime);
  EXPECT_EQ(mirror.generation(), 2u);

  // Completing the rotation installs it.
  WriteAtomically(sources.files.cert, ReadAll(m.ec_other.cert));
  changed = mirror.Refresh();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(mirror.generation(), 3u);
  ExpectMirrorHolds(mirror, m.ec_other);
  EXPECT_GT(MtimeOf(mirror.mirrored().key), second_mtime);
}

TEST(TlsMirror, UnreadableExpiredOrGarbageSourcesKeepTheSet) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  auto created = TlsFileMirror::Create(sources.files, dir.File("mirror"));
  ASSERT_TRUE(created.ok()) << created.status();
  TlsFileMirror& mirror = **created;

  ASSERT_EQ(std::remove(sources.files.key.c_str()), 0);
  EXPECT_THAT(Message(mirror.Refresh().status()), HasSubstr("setting 'tls_key': cannot read"));
  ExpectMirrorHolds(mirror, m.ec);

  sources.Install(m.expired);
  EXPECT_THAT(Message(mirror.Refresh().status()), HasSubstr("expired at"));
  ExpectMirrorHolds(mirror, m.ec);

  WriteAtomically(sources.files.cert, "garbage\n");
  WriteAtomically(sources.files.key, ReadAll(m.ec.key));
  EXPECT_THAT(Message(mirror.Refresh().status()), HasSubstr("setting 'tls_cert'"));
  ExpectMirrorHolds(mirror, m.ec);
  EXPECT_EQ(mirror.generation(), 1u);
  EXPECT_TRUE(ValidateTlsFiles(mirror.mirrored()).ok());
}

TEST(TlsMirror, ClientCaRotation) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir, /*with_client_ca=*/true);
  auto created = TlsFileMirror::Create(sources.files, dir.File("mirror"));
  ASSERT_TRUE(created.ok()) << created.status();
  TlsFileMirror& mirror = **created;
  ASSERT_EQ(mirror.mirrored().client_ca, dir.File("mirror") + "/tls_client_ca.pem");
  EXPECT_EQ(ReadAll(mirror.mirrored().client_ca), ReadAll(m.ca.cert));
  EXPECT_EQ(ModeOf(mirror.mirrored().client_ca), 0600u);

  WriteAtomically(sources.files.client_ca, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  EXPECT_THAT(Message(mirror.Refresh().status()), HasSubstr("setting 'tls_client_ca'"));
  EXPECT_EQ(ReadAll(mirror.mirrored().client_ca), ReadAll(m.ca.cert));

  WriteAtomically(sources.files.client_ca, ReadAll(m.ca_bundle));
  auto changed = mirror.Refresh();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(ReadAll(mirror.mirrored().client_ca), ReadAll(m.ca_bundle));
  ExpectMirrorHolds(mirror, m.ec);
}

TEST(TlsMirror, KeepsTheCurrentAndThePreviousSetOnly) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  const std::string mirror_dir = dir.File("mirror");
  auto created = TlsFileMirror::Create(sources.files, mirror_dir);
  ASSERT_TRUE(created.ok()) << created.status();
  for (const Pair* pair : {&m.rsa, &m.ec_other, &m.ed25519}) {
    sources.Install(*pair);
    auto changed = (*created)->Refresh();
    ASSERT_TRUE(changed.ok()) << changed.status();
    ASSERT_TRUE(*changed);
  }
  EXPECT_EQ((*created)->generation(), 4u);
  EXPECT_FALSE(std::filesystem::exists(mirror_dir + "/set-1"));
  EXPECT_FALSE(std::filesystem::exists(mirror_dir + "/set-2"));
  EXPECT_TRUE(std::filesystem::exists(mirror_dir + "/set-3"));
  EXPECT_TRUE(std::filesystem::exists(mirror_dir + "/set-4"));
  EXPECT_EQ(std::filesystem::read_symlink(mirror_dir + "/current"), "set-4");
  ExpectMirrorHolds(**created, m.ed25519);
}

TEST(TlsMirror, CreateReplacesALeftoverMirrorAndLeavesOtherFiles) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  const std::string mirror_dir = dir.File("mirror");
  ASSERT_EQ(::mkdir(mirror_dir.c_str(), 0755), 0);
  std::ofstream(mirror_dir + "/README") << "not the mirror's\n";
  {
    auto first = TlsFileMirror::Create(sources.files, mirror_dir);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(ModeOf(mirror_dir), 0700u);  // an existing folder is made private
    sources.Install(m.rsa);
    ASSERT_TRUE((*first)->Refresh().ok());
  }
  // The destructor leaves the set in service in place.
  EXPECT_EQ(ReadAll(mirror_dir + "/tls_key.pem"), ReadAll(m.rsa.key));

  sources.Install(m.ec_other);
  auto second = TlsFileMirror::Create(sources.files, mirror_dir);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->generation(), 1u);
  ExpectMirrorHolds(**second, m.ec_other);
  EXPECT_FALSE(std::filesystem::exists(mirror_dir + "/set-2"));
  EXPECT_EQ(ReadAll(mirror_dir + "/README"), "not the mirror's\n");
}

TEST(TlsMirror, RefusesUnusableFolders) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  // The folder of the sources: clearing it would delete the operator's files.
  auto same = TlsFileMirror::Create(sources.files, dir.path());
  ASSERT_FALSE(same.ok());
  EXPECT_THAT(Message(same.status()),
              AllOf(HasSubstr("setting 'tls_cert'"), HasSubstr("lies in the TLS mirror folder")));
  EXPECT_EQ(ReadAll(sources.files.key), ReadAll(m.ec.key));

  const std::string file = dir.File("a-file");
  std::ofstream(file) << "x";
  EXPECT_FALSE(TlsFileMirror::Create(sources.files, file).ok());
  const std::string link = dir.File("a-link");
  ASSERT_EQ(::mkdir(dir.File("target").c_str(), 0700), 0);
  ASSERT_EQ(::symlink(dir.File("target").c_str(), link.c_str()), 0);
  auto through_link = TlsFileMirror::Create(sources.files, link);
  ASSERT_FALSE(through_link.ok());
  EXPECT_EQ(through_link.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Reads the mirrored pair the way gRPC 1.51's FileWatcherCertificateProvider does (stat key and
// cert, read key, read cert, stat both again, keep the pair only if both modification times in
// whole seconds are unchanged) while the mirror rotates between two pairs. A kept pair must
// always be a pair of one set.
TEST(TlsMirror, AWatcherStyleReaderNeverKeepsAMixedPair) {
  const Material& m = Material::Get();
  ScratchDir dir;
  Sources sources(dir);
  auto created = TlsFileMirror::Create(sources.files, dir.File("mirror"));
  ASSERT_TRUE(created.ok()) << created.status();
  TlsFileMirror& mirror = **created;
  const TlsFiles watched = mirror.mirrored();
  const std::string cert_a = ReadAll(m.ec.cert), key_a = ReadAll(m.ec.key);
  const std::string cert_b = ReadAll(m.ec_other.cert), key_b = ReadAll(m.ec_other.key);

  std::atomic<bool> stop{false};
  std::atomic<int> kept{0}, kept_mixed{0}, discarded{0}, read_mixed{0}, failed_reads{0};
  auto mtime = [](const std::string& path) -> std::time_t {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 ? st.st_mtime : 0;
  };
  std::thread reader([&] {
    while (!stop.load()) {
      const std::time_t key_before = mtime(watched.key), cert_before = mtime(watched.cert);
      if (key_before == 0 || cert_before == 0) {
        ++failed_reads;
        continue;
      }
      const std::string key = ReadAll(watched.key);
      const std::string cert = ReadAll(watched.cert);
      const bool consistent = (key == key_a && cert == cert_a) || (key == key_b && cert == cert_b);
      if (!consistent) ++read_mixed;
      if (mtime(watched.key) != key_before || mtime(watched.cert) != cert_before) {
        ++discarded;
        continue;
      }
      ++kept;
      if (!consistent) ++kept_mixed;
    }
  });
  // Another thread reads the accessors and refreshes concurrently (nothing to install for it
  // most of the time; it must neither block nor corrupt anything).
  std::thread prober([&] {
    while (!stop.load()) {
      EXPECT_EQ(mirror.mirrored().key, watched.key);
      EXPECT_GE(mirror.generation(), 1u);
      std::this_thread::yield();
    }
  });
  constexpr int kRotations = 60;
  int installed = 0;
  for (int i = 0; i < kRotations; ++i) {
    sources.Install(i % 2 == 0 ? m.ec_other : m.ec);
    auto changed = mirror.Refresh();
    ASSERT_TRUE(changed.ok()) << changed.status();
    installed += *changed ? 1 : 0;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // Once the rotations are over, the reader keeps pairs; wait for one (however slow the machine).
  for (int waited_ms = 0; kept.load() == 0 && waited_ms < 10000; waited_ms += 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop.store(true);
  reader.join();
  prober.join();
  EXPECT_EQ(installed, kRotations);
  EXPECT_EQ(mirror.generation(), 1u + kRotations);
  EXPECT_EQ(kept_mixed.load(), 0) << "the reader kept a key and a certificate of different sets";
  EXPECT_GT(kept.load(), 0);
  std::cout << "watcher-style reads: kept " << kept << ", discarded by the mtime check " << discarded
            << " (of which mixed " << read_mixed << " in total), failed " << failed_reads << "\n";
}

}  // namespace
}  // namespace eldr::server
