"""Checks docker/Dockerfile without a container engine: its steps only call scripts this suite runs,
the runtime stage's package list is exactly what `ldd` says the shipped binaries load, and what the
image declares (user, ports, entry point) agrees with the Kubernetes manifests."""

import os
import re
import shlex
import subprocess
import tempfile
import unittest

import deploy_testlib as lib

DOCKERFILE = os.path.join(lib.SOURCE_DIR, "docker", "Dockerfile")
PACKAGE_LIST = os.path.join(lib.SOURCE_DIR, "docker", "runtime-packages.txt")
RUNTIME_LIBS = os.path.join(lib.SOURCE_DIR, "scripts", "runtime-libs.sh")


def parse_dockerfile(path):
    """[(stage name, [(instruction, argument text)])], with continuation lines joined."""
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            stages.append((match.group(2), [(instruction, match.group(1))]))
        elif instruction == "ARG" and not stages:
            continue
        else:
            stages[-1][1].append((instruction, rest.strip()))
    return stages


def exec_form(text):
    import json
    return json.loads(text)


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stages = dict(parse_dockerfile(DOCKERFILE))
        cls.build = cls.stages["build"]
        cls.runtime = cls.stages["runtime"]

    def instructions(self, stage, name):
        return [arg for instruction, arg in stage if instruction == name]

    def shipped_binaries(self):
        """Binary names the runtime stage copies from the build stage."""
        (copy,) = [a for a in self.instructions(self.runtime, "COPY") if a.startswith("--from=build")]
        sources = shlex.split(copy)[1:-1]
        self.assertEqual(shlex.split(copy)[-1], lib.IMAGE_BIN_DIR + "/")
        for source in sources:
            self.assertTrue(source.startswith("/build/bin/"), source)
        return [os.path.basename(s) for s in sources]

    def test_stages_are_debian_bookworm(self):
        self.assertEqual(list(self.stages), ["build", "runtime"])
        self.assertEqual(self.build[0][1], "debian:${DEBIAN_RELEASE}")
        self.assertEqual(self.runtime[0][1], "debian:${DEBIAN_RELEASE}-slim")
        with open(DOCKERFILE) as f:
            self.assertIn("ARG DEBIAN_RELEASE=bookworm", f.read())

    def test_steps_only_call_tested_scripts(self):
        # Build stage: the install script, the Makefile's build (what `make test` and CI run first),
        # and the library check; runtime stage: the package installation.
        build_runs = self.instructions(self.build, "RUN")
        self.assertEqual(build_runs[0], "scripts/install-deps.sh")
        # The compile keeps ccache's directory in a build cache mount (faster rebuilds, no layer)
        # and builds exactly the shipped binaries' targets.
        prefix = "--mount=type=cache,target=/root/.cache/ccache make build BUILD_DIR=/build TARGETS="
        self.assertTrue(build_runs[1].startswith(prefix), build_runs[1])
        self.assertEqual(shlex.split(build_runs[1][len(prefix):]), [" ".join(self.shipped_binaries())])
        cmake_lists = []
        for root, _, files in os.walk(os.path.join(lib.SOURCE_DIR, "src")):
            if "CMakeLists.txt" in files:
                with open(os.path.join(root, "CMakeLists.txt")) as f:
                    cmake_lists.append(f.read())
        for binary in self.shipped_binaries():
            self.assertTrue(any(f"add_executable({binary} " in text for text in cmake_lists),
                            f"{binary} is not a CMake executable target")
        self.assertTrue(build_runs[2].startswith("scripts/runtime-libs.sh check docker/runtime-packages.txt "))
        self.assertEqual(len(build_runs), 3)
        (runtime_run,) = self.instructions(self.runtime, "RUN")
        self.assertEqual(runtime_run,
                         "/opt/eldr-image/runtime-libs.sh install /opt/eldr-image/runtime-packages.txt")
        for script in ("scripts/install-deps.sh", "scripts/runtime-libs.sh"):
            self.assertTrue(os.access(os.path.join(lib.SOURCE_DIR, script), os.X_OK), script)
        with open(os.path.join(lib.SOURCE_DIR, "Makefile")) as f:
            makefile = f.read()
        self.assertRegex(makefile, r"(?m)^build:")
        self.assertRegex(makefile, r"(?m)^test: build$", "make test builds with the same target")

    def test_library_check_covers_the_shipped_binaries(self):
        check = self.instructions(self.build, "RUN")[2]
        checked = [os.path.basename(p) for p in shlex.split(check)[3:]]
        self.assertEqual(checked, self.shipped_binaries())
        self.assertIn("eldr-router", checked)
        self.assertIn("eldr-health-probe", checked)

    def test_runtime_user_ports_and_entrypoint(self):
        (user,) = self.instructions(self.runtime, "USER")
        uid, gid = (int(x) for x in user.split(":"))
        self.assertNotEqual(uid, 0)
        self.assertNotEqual(gid, 0)
        (expose,) = self.instructions(self.runtime, "EXPOSE")
        exposed = {int(p) for p in expose.split()}
        (entrypoint,) = self.instructions(self.runtime, "ENTRYPOINT")
        (cmd,) = self.instructions(self.runtime, "CMD")
        defaults = lib.flag_values(exec_form(cmd))
        public_flags = ("listen", "metrics_listen")
        for flag in public_flags:
            self.assertIn(lib.split_host_port(defaults[flag])[1], exposed, flag)
        admin_host, admin_port = lib.split_host_port(defaults["admin_listen"])
        self.assertEqual(admin_host, "127.0.0.1")
        self.assertNotIn(admin_port, exposed, "the loopback-only admin port is not exposed")
        for overlay in lib.OVERLAYS:
            with self.subTest(overlay=overlay):
                _, spec, container = lib.router_workload(lib.render_overlay(overlay))
                self.assertEqual(exec_form(entrypoint), container["command"])
                self.assertEqual(container["securityContext"]["runAsUser"], uid)
                self.assertEqual(container["securityContext"]["runAsGroup"], gid)
                flags = lib.flag_values(container["args"])
                for flag in public_flags:
                    self.assertIn(lib.split_host_port(flags[flag])[1], exposed, flag)
                self.assertEqual(lib.split_host_port(flags["admin_listen"]),
                                 (admin_host, admin_port))
                # Every binary a probe or hook runs is in the image.
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    probe = container[kind]
                    if "exec" in probe:
                        binary = probe["exec"]["command"][0]
                        self.assertTrue(binary.startswith(lib.IMAGE_BIN_DIR + "/"))
                        self.assertIn(os.path.basename(binary), self.shipped_binaries())
        (healthcheck,) = self.instructions(self.runtime, "HEALTHCHECK")
        probe = exec_form(healthcheck.split(" CMD ", 1)[1])
        self.assertEqual(probe[0], lib.IMAGE_BIN_DIR + "/eldr-health-probe")
        addr = lib.flag_values(probe[1:])["addr"]
        self.assertEqual(lib.split_host_port(addr)[1], lib.split_host_port(defaults["listen"])[1])

    def test_build_context_excludes_build_outputs(self):
        with open(DOCKERFILE + ".dockerignore") as f:
            patterns = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        for pattern in (".git", "build", "build-*"):
            self.assertIn(pattern, patterns)

    # ---- the package list against ldd ----
    def built_binaries(self):
        return [lib.require_binary(name) for name in self.shipped_binaries()]

    def test_package_list_matches_ldd_of_the_built_binaries(self):
        result = lib.run([RUNTIME_LIBS, "check", PACKAGE_LIST] + self.built_binaries())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_every_listed_package_installs(self):
        # apt-get's simulation resolves each name against the package database, as the image
        # build would.
        result = lib.run([RUNTIME_LIBS, "install", PACKAGE_LIST, "--dry-run"])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_check_fails_on_a_stale_list(self):
        binaries = self.built_binaries()
        packages = lib.run([RUNTIME_LIBS, "packages"] + binaries)
        self.assertEqual(packages.returncode, 0, packages.stderr)
        needed = packages.stdout.split()
        self.assertIn("libc6", needed)
        self.assertTrue(any(p.startswith("libgrpc") for p in needed), needed)
        with tempfile.TemporaryDirectory() as folder:
            missing = os.path.join(folder, "missing.txt")
            with open(missing, "w") as f:
                f.write("\n".join(p for p in needed if not p.startswith("libgrpc")) + "\n")
            result = lib.run([RUNTIME_LIBS, "check", missing] + binaries)
            self.assertEqual(result.returncode, 1)
            self.assertRegex(result.stderr, r"missing \(a binary needs them\): .*libgrpc")
            superfluous = os.path.join(folder, "superfluous.txt")
            with open(superfluous, "w") as f:
                f.write("\n".join(needed + ["libpng16-16"]) + "\n")
            result = lib.run([RUNTIME_LIBS, "check", superfluous] + binaries)
            self.assertEqual(result.returncode, 1)
            self.assertIn("superfluous", result.stderr)
            self.assertIn("libpng16-16", result.stderr)
            explained = os.path.join(folder, "explained.txt")
            with open(explained, "w") as f:
                f.write("\n".join(needed + ["libpng16-16  # extra: kept on purpose"]) + "\n")
            result = lib.run([RUNTIME_LIBS, "check", explained] + binaries)
            self.assertEqual(result.returncode, 0, result.stderr)

    def test_shipped_binaries_load_and_start(self):
        # Each binary's dynamic loader finds every library (no `not found`) and answers --help.
        for binary in self.built_binaries():
            with self.subTest(binary=os.path.basename(binary)):
                result = subprocess.run([binary, "--help"], capture_output=True, text=True,
                                        timeout=30)
                self.assertNotIn("error while loading shared libraries", result.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
