"""Bad input at every entry point: one line naming the problem, no half-written output.

The command line exits 2 with exactly one line, ``autotune: error: ...``, and no
traceback; the Python API raises the documented AutotuneError subclass. Both tables below
are the specification: each row is an input a user may really give and the words the
answer must contain. CLI rows call ``autotune.cli.main`` in-process (the console script's
own entry point, and much faster than a fresh interpreter per row); a few rows run a real
``autotune`` process, and the rows that need an unprivileged user run in one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from test_models import synthetic_profile

import autotune
from autotune.cli import main
from autotune.emulate import EmulatedCluster
from autotune.errors import (
    AutotuneError,
    ClusterError,
    PolicyError,
    ProfileError,
    WorkloadError,
)
from autotune.jsonio import check_writable
from autotune.models.cost_model import CostModel, load_cost_model
from autotune.policies import Policy, load_policy
from autotune.probes.profile import Profile, load_profile
from autotune.workloads import resolve_workload

KEEP = "an older file that a failed command must leave as it was\n"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of good and bad inputs, shared by every row."""
    d = tmp_path_factory.mktemp("inputs")
    profile = synthetic_profile("mlp")
    profile.save(d / "profile.json")
    text = (d / "profile.json").read_text()
    data = json.loads(text)

    def profile_with(change: Callable[[dict[str, Any]], None], name: str) -> None:
        bad = json.loads(text)
        change(bad)
        (d / name).write_text(json.dumps(bad))

    profile_with(lambda p: p.__setitem__("version", 2), "v2_profile.json")
    profile_with(lambda p: p["env"].__setitem__("world_size", 0), "ws0_profile.json")
    profile_with(lambda p: p["compute"].pop("backward_s"), "old_profile.json")
    profile_with(lambda p: p["network"]["samples"].__setitem__(0, "4096 bytes"), "sample_profile.json")
    (d / "nan_profile.json").write_text(json.dumps(data).replace('"step_s": [0.3', '"step_s": [NaN', 1))
    (d / "truncated_profile.json").write_text(text[: len(text) // 2])

    good = {"version": 1, "bucket_cap_mb": 25, "default": {"compressor": "fp16"},
            "layers": {"0.weight": {"compressor": "powersgd", "rank": 2}}}
    (d / "policy.json").write_text(json.dumps(good))
    (d / "truncated_policy.json").write_text(json.dumps(good, indent=1)[:40])
    (d / "v2_policy.json").write_text(json.dumps({**good, "version": 2}))
    (d / "lz4_policy.json").write_text(json.dumps({"version": 1, "default": {"compressor": "lz4"}}))
    (d / "nan_policy.json").write_text('{"version": 1, "bucket_cap_mb": NaN}')
    (d / "inf_policy.json").write_text('{"version": 1, "bucket_cap_mb": 1e999}')
    (d / "cap_policy.json").write_text('{"version": 1, "bucket_cap_mb": 5000}')
    (d / "ring_policy.json").write_text('{"version": 1, "topology": "ring"}')
    (d / "rank0_policy.json").write_text(
        json.dumps({"version": 1, "default": {"compressor": "powersgd", "rank": 0}}))
    (d / "other_model_policy.json").write_text(
        json.dumps({"version": 1, "layers": {"fc1.weight": {"compressor": "powersgd", "rank": 4}}}))

    CostModel.fit(profile).save(d / "model.json")
    model = json.loads((d / "model.json").read_text())
    (d / "old_model.json").write_text(json.dumps({**model, "autotune": "0.0.1"}))
    (d / "garbled_model.json").write_text(json.dumps({**model, "comm": {"allreduce": {"alpha_": 1}}}))

    (d / "binary.json").write_bytes(bytes(range(256)))
    (d / "dir.json").mkdir()
    (d / "a_file").write_text("not a directory\n")
    (d / "existing.json").write_text(KEEP)
    (d / "syntax.py").write_text("def make(:\n    pass\n")
    (d / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (d / "binary.py").write_bytes(b"\x00\xff\xfe" * 10)
    return d


# --------------------------------------------------------------------- command line


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # "{d}" stands for the inputs directory
    expect: str  # the one line must contain this
    out: str | None = None  # this output must not exist afterwards, or keep its content


def case(id: str, argv: str, expect: str, out: str | None = None) -> Case:
    return Case(id, tuple(argv.split()), expect, out)


CLI_CASES = [
    # malformed, truncated, not JSON at all
    case("show: missing file", "show {d}/missing.json", "missing.json: cannot read policy or profile: No such file"),
    case("show: a directory", "show {d}/dir.json", "dir.json: cannot read policy or profile: Is a directory"),
    case("show: binary file", "show {d}/binary.json", "binary.json: not UTF-8 text (byte 128)"),
    case("show: truncated policy", "show {d}/truncated_policy.json", "truncated_policy.json: malformed JSON at line"),
    case("show: truncated profile", "show {d}/truncated_profile.json", "truncated_profile.json: malformed JSON at line"),
    # wrong version, unknown compressor, out of range, NaN and infinity
    case("show: policy version 2", "show {d}/v2_policy.json", "v2_policy.json: version: expected 1, got 2"),
    case("show: profile version 2", "show {d}/v2_profile.json", "v2_profile.json: version: expected 1, got 2"),
    case("show: unknown compressor", "show {d}/lz4_policy.json",
         "lz4_policy.json: default: unknown compressor 'lz4'; registered: none, fp16"),
    case("show: PowerSGD rank 0", "show {d}/rank0_policy.json",
         "The 'rank' parameter of powersgd must be an int in the range [1, 1024]. Got 0 instead."),
    case("show: bucket cap 5000", "show {d}/cap_policy.json",
         "bucket_cap_mb: expected a number in the range (0, 1024], got 5000"),
    case("show: unknown topology", "show {d}/ring_policy.json",
         "ring_policy.json: topology: expected one of 'flat', 'hierarchical', got 'ring'"),
    case("show: NaN", "show {d}/nan_policy.json", "nan_policy.json: NaN is not valid JSON; numbers must be finite"),
    case("show: 1e999", "show {d}/inf_policy.json", "inf_policy.json: number 1e999 is out of range"),
    case("show: NaN in a profile", "show {d}/nan_profile.json", "nan_profile.json: NaN is not valid JSON"),
    case("show: world size 0", "show {d}/ws0_profile.json", "env.world_size: expected an integer >= 1, got 0"),
    # profile problems at tune and simulate; the output is never written
    case("tune: truncated profile", "tune {d}/truncated_profile.json --out {d}/t1.json",
         "malformed JSON at line", out="{d}/t1.json"),
    case("tune: profile version 2", "tune {d}/v2_profile.json --out {d}/existing.json",
         "version: expected 1, got 2", out="{d}/existing.json"),
    case("tune: profile without compute.backward_s", "tune {d}/old_profile.json --out {d}/t2.json",
         "old_profile.json: compute.backward_s: missing", out="{d}/t2.json"),
    case("tune: a sample that is a string", "tune {d}/sample_profile.json --out {d}/t3.json",
         "network.samples[0]: expected an object, got a string", out="{d}/t3.json"),
    case("tune: a policy file as the profile", "tune {d}/policy.json --out {d}/t4.json",
         "policy.json: (top level): this is a policy, not a profile", out="{d}/t4.json"),
    case("simulate: NaN in the profile", "simulate {d}/nan_profile.json", "NaN is not valid JSON"),
    case("simulate: --compute-speed nan", "simulate {d}/profile.json --compute-speed nan",
         "argument --compute-speed: expected a positive number, got 'nan'"),
    case("simulate: --bandwidth fast", "simulate {d}/profile.json --bandwidth fast",
         "argument --bandwidth: cannot parse link 'fast'"),
    # a policy from another model, or a bad policy, where a policy is applied
    case("simulate: policy for another model", "simulate {d}/profile.json --policy {d}/other_model_policy.json",
         "other_model_policy.json: names parameters the profiled model lacks: fc1.weight"),
    case("simulate: truncated policy", "simulate {d}/profile.json --policy {d}/truncated_policy.json",
         "truncated_policy.json: malformed JSON"),
    case("bench: policy for another model", "bench --workload mlp --policy {d}/other_model_policy.json",
         "other_model_policy.json on --workload mlp: layers: 1 name(s) match no trainable parameter "
         "of the model: 'fc1.weight'"),
    case("bench: NaN policy", "bench --workload mlp --policy {d}/nan_policy.json --json {d}/b1.json",
         "NaN is not valid JSON", out="{d}/b1.json"),
    case("bench: unknown compressor", "bench --workload mlp --policy {d}/lz4_policy.json",
         "unknown compressor 'lz4'"),
    # the job differs from the profile
    case("tune --verify: another workload", "tune {d}/profile.json --verify 1 --workload cnn --out {d}/t5.json",
         "--workload cnn is not the profiled model (mlp): 10 profiled parameter(s) missing",
         out="{d}/t5.json"),
    # workloads that cannot be loaded
    case("bench: workload file missing", "bench --workload {d}/nosuch.py:make", "workload file not found"),
    case("bench: workload file is a directory", "bench --workload {d}/dir.json/:make", "is not a regular file"),
    case("bench: workload file with a syntax error", "bench --workload {d}/syntax.py:make",
         "syntax.py failed: SyntaxError"),
    case("bench: workload file that calls sys.exit", "bench --workload {d}/exits.py:make",
         "exits.py failed: SystemExit: 3"),
    case("bench: binary workload file", "bench --workload {d}/binary.py:make", "binary.py failed: SyntaxError"),
    case("profile: unknown workload", "profile --workload nosuch --out {d}/p1.json",
         "unknown workload 'nosuch'", out="{d}/p1.json"),
    # outputs that cannot be written: refused before any work
    case("tune: --out in a missing directory", "tune {d}/profile.json --out {d}/nodir/p.json",
         "nodir/p.json: cannot write policy: directory", out="{d}/nodir/p.json"),
    case("tune: --out under a file", "tune {d}/profile.json --out {d}/a_file/p.json",
         "a_file/p.json: cannot write policy: ", out="{d}/a_file/p.json"),
    case("tune: --out is a directory", "tune {d}/profile.json --out {d}/dir.json",
         "dir.json: cannot write policy: is a directory"),
    case("profile: --out under a file", "profile --workload mlp --out {d}/a_file/p.json",
         "a_file/p.json: cannot write profile: ", out="{d}/a_file/p.json"),
    case("bench: --json in a missing directory", "bench --workload mlp --json {d}/nodir/r.json",
         "cannot write results: directory", out="{d}/nodir/r.json"),
    case("simulate: --trace in a missing directory", "simulate {d}/profile.json --trace {d}/nodir/t.json",
         "cannot write trace: directory", out="{d}/nodir/t.json"),
    # flags
    case("profile: --hosts without --link", "profile --hosts 2 --out {d}/p2.json", "--hosts 2 needs --link RATE"),
    case("profile: --link on one host", "profile --link 1gbit --out {d}/p3.json", "give --hosts 2 or more"),
    case("profile: --budget-s nan", "profile --budget-s nan", "argument --budget-s: expected a positive number"),
    case("tune: --storage not a URL", "tune {d}/profile.json --storage study.db --out {d}/existing.json",
         "--storage must be an Optuna storage URL", out="{d}/existing.json"),
]


def _check_out(out: str | None, d: Path) -> None:
    if out is None:
        return
    path = Path(out.format(d=d))
    if path.name == "existing.json":
        assert path.read_text() == KEEP, "a failed command changed an existing output"
    else:
        assert not path.exists(), f"a failed command wrote {path}"
    leftovers = [p.name for p in path.parent.glob(f".{path.name}.*")] if path.parent.is_dir() else []
    assert not leftovers, f"temporary files left behind: {leftovers}"


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_cli_rejects_bad_input_in_one_line(d: Path, case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    status = main([arg.format(d=d) for arg in case.argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("autotune: error: ") and "Traceback" not in err
    assert case.expect.format(d=d) in err, err
    _check_out(case.out, d)


def test_unwritable_output_is_refused_before_the_search(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory no one may write (sysfs refuses new files even to root)."""
    target = Path("/sys/autotune-policy.json")
    if not Path("/sys").is_dir() or _can_create_in(Path("/sys")):
        pytest.skip("needs a directory that refuses new files even to this user (/sys on Linux)")
    assert main(["tune", str(d / "profile.json"), "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/sys/autotune-policy.json: cannot write policy: Permission denied" in err
    assert not target.exists()


def _can_create_in(directory: Path) -> bool:
    try:
        check_writable(directory / "probe", AutotuneError, "probe")
    except AutotuneError:
        return False
    return True


def _autotune() -> list[str]:
    exe = shutil.which("autotune")
    return [exe] if exe else [sys.executable, "-m", "autotune"]


@pytest.mark.slow
def test_a_real_autotune_process_prints_one_line_and_no_traceback(d: Path) -> None:
    for argv, expect in [
        (["tune", str(d / "truncated_profile.json"), "--out", str(d / "r1.json")], "malformed JSON at line"),
        (["bench", "--workload", f"{d}/exits.py:make"], "failed: SystemExit: 3"),
    ]:
        proc = subprocess.run([*_autotune(), *argv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("autotune: error: ")
        assert expect in proc.stderr and "Traceback" not in proc.stderr
        assert not (d / "r1.json").exists()


# ------------------------------------------------------------ an unprivileged user

_UNPRIVILEGED = r"""
import contextlib, io, json, os, sys
from autotune.cli import main
from autotune.emulate import EmulatedCluster
from autotune.errors import AutotuneError
d = sys.argv[1]
out = {"euid": os.geteuid()}
for name, argv in {
    "profile on an emulated cluster": ["profile", "--workload", "mlp", "--hosts", "2",
                                       "--nproc-per-node", "1", "--link", "1gbit",
                                       "--out", f"{d}/p.json"],
    "show an unreadable policy": ["show", f"{d}/secret.json"],
    "tune into a read-only directory": ["tune", f"{d}/profile.json", "--out", f"{d}/ro/policy.json"],
}.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    out[name] = {"status": status, "err": err.getvalue()}
from autotune.emulate import EmulatedCluster
from autotune.policies import load_policy
for name, call in {"EmulatedCluster": lambda: EmulatedCluster(2, "1gbit").__enter__(),
                   "load_policy": lambda: load_policy(f"{d}/secret.json")}.items():
    try:
        call()
        out[name] = {"raised": None}
    except AutotuneError as exc:
        out[name] = {"raised": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""


def _unprivileged_prefix() -> list[str]:
    """How to run a process without root's privileges here.

    `setpriv`/`runuser` to nobody would be the usual way, but nobody cannot reach this
    interpreter when it lives under /root (mode 0700). A user namespace (`unshare
    --user`) is as unprivileged for the kernel: no capabilities, euid 65534, so mode
    bits apply (chmod 000 really is unreadable) and creating network namespaces fails.
    """
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("running as root and `unshare` (util-linux) is missing: no way to drop privileges")
    probe = subprocess.run([unshare, "--user", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and user namespaces are unavailable: {probe.stderr.strip()}")
    return [unshare, "--user"]


def test_without_root_each_problem_is_one_line(tmp_path: Path) -> None:
    prefix = _unprivileged_prefix()
    synthetic_profile("mlp").save(tmp_path / "profile.json")
    (tmp_path / "secret.json").write_text('{"version": 1}')
    (tmp_path / "secret.json").chmod(0o000)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        proc = subprocess.run([*prefix, sys.executable, "-c", _UNPRIVILEGED, str(tmp_path)],
                              capture_output=True, text=True, timeout=300)
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["euid"] != 0
    expected = {
        "profile on an emulated cluster": "cannot build an emulated cluster here: needs root",
        "show an unreadable policy": "secret.json: cannot read policy or profile: Permission denied",
        "tune into a read-only directory": "ro/policy.json: cannot write policy: Permission denied",
    }
    for name, words in expected.items():
        got = result[name]
        assert got["status"] == 2 and got["err"].count("\n") == 1, (name, got)
        assert words in got["err"] and "Traceback" not in got["err"], (name, got)
    assert result["EmulatedCluster"]["raised"] == "ClusterError"
    assert "needs root to create network namespaces" in result["EmulatedCluster"]["message"]
    assert result["load_policy"]["raised"] == "PolicyError"
    assert "Permission denied" in result["load_policy"]["message"]
    assert not (tmp_path / "p.json").exists() and not list((tmp_path / "ro").iterdir())


# --------------------------------------------------------------------------- tune --verify


@pytest.mark.multirank
def test_verify_on_another_cluster_warns_and_chooses_by_measurement(
    d: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Allowed with a warning: a policy applies at any world size, and --verify decides by
    what it measures on the live job (here 1 local rank; the profile had 2 hosts)."""
    out = d / "verified.json"
    status = main(["tune", str(d / "profile.json"), "--verify", "1", "--trials", "4",
                   "--hosts", "1", "--nproc-per-node", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "warning: the profile was taken on 2 rank(s) on 2 host(s) at 1000mbit; verifying on " \
           "1 rank(s) on 1 host(s)" in " ".join(err.split())
    policy = load_policy(out)
    assert policy.meta["verified"] and policy.meta["chosen"] in policy.meta["verified"]


# ------------------------------------------------------------------------- Python API


def _mlp() -> Any:
    return resolve_workload("mlp").model


API_CASES: list[tuple[str, Callable[[Path], Any], type[AutotuneError], str]] = [
    ("load_policy: missing", lambda d: load_policy(d / "missing.json"), PolicyError, "No such file"),
    ("load_policy: directory", lambda d: load_policy(d / "dir.json"), PolicyError, "Is a directory"),
    ("load_policy: binary", lambda d: load_policy(d / "binary.json"), PolicyError, "not UTF-8 text"),
    ("load_policy: endless device", lambda d: load_policy("/dev/zero"), PolicyError, "larger than 256 MiB"),
    ("load_policy: truncated", lambda d: load_policy(d / "truncated_policy.json"), PolicyError, "malformed JSON"),
    ("load_policy: version 2", lambda d: load_policy(d / "v2_policy.json"), PolicyError, "version: expected 1, got 2"),
    ("load_policy: unknown compressor", lambda d: load_policy(d / "lz4_policy.json"), PolicyError, "'lz4'"),
    ("load_policy: NaN", lambda d: load_policy(d / "nan_policy.json"), PolicyError, "NaN is not valid JSON"),
    ("load_policy: 1e999", lambda d: load_policy(d / "inf_policy.json"), PolicyError, "1e999 is out of range"),
    ("load_policy: rank 0", lambda d: load_policy(d / "rank0_policy.json"), PolicyError, "Got 0 instead"),
    ("Policy.from_dict: NaN", lambda d: Policy.from_dict({"version": 1, "bucket_cap_mb": math.nan}),
     PolicyError, "bucket_cap_mb: expected a number in the range (0, 1024], got nan"),
    ("Policy.from_dict: version 1.0", lambda d: Policy.from_dict({"version": 1.0}),
     PolicyError, "version: expected 1, got 1.0"),
    ("Policy.from_dict: version true", lambda d: Policy.from_dict({"version": True}),
     PolicyError, "version: expected 1, got True"),
    ("Policy.from_dict: a parameter called 'name'",
     lambda d: Policy.from_dict({"version": 1, "default": {"compressor": "topk", "name": "x"}}),
     PolicyError, "compressor 'topk' has no parameter 'name'"),
    ("Policy.from_dict: an int beyond any float",
     lambda d: Policy.from_dict({"version": 1, "default": {"compressor": "powersgd", "rank": 10**400}}),
     PolicyError, "The 'rank' parameter of powersgd must be an int"),
    ("wrap: truncated policy file", lambda d: autotune.wrap(_mlp(), d / "truncated_policy.json"),
     PolicyError, "malformed JSON"),
    ("wrap: NaN policy file", lambda d: autotune.wrap(_mlp(), str(d / "nan_policy.json")), PolicyError, "NaN"),
    ("wrap: policy for another model", lambda d: autotune.wrap(_mlp(), d / "other_model_policy.json"),
     PolicyError, "1 name(s) match no trainable parameter of the model: 'fc1.weight'"),
    ("load_profile: truncated", lambda d: load_profile(d / "truncated_profile.json"), ProfileError, "malformed JSON"),
    ("load_profile: version 2", lambda d: load_profile(d / "v2_profile.json"), ProfileError, "version: expected 1"),
    ("load_profile: NaN", lambda d: load_profile(d / "nan_profile.json"), ProfileError, "NaN is not valid JSON"),
    ("load_profile: world size 0", lambda d: load_profile(d / "ws0_profile.json"), ProfileError, "env.world_size"),
    ("load_profile: no backward_s", lambda d: load_profile(d / "old_profile.json"), ProfileError,
     "compute.backward_s: missing"),
    ("load_profile: binary", lambda d: load_profile(d / "binary.json"), ProfileError, "not UTF-8 text"),
    ("load_profile: a policy", lambda d: load_profile(d / "policy.json"), ProfileError,
     "this is a policy, not a profile"),
    ("load_policy: a profile", lambda d: load_policy(d / "profile.json"), PolicyError,
     "this is a profile, not a policy"),
    ("Profile.from_dict: infinity where nothing checks",
     lambda d: Profile.from_dict({**load_profile(d / "profile.json").to_dict(), "workload": {
         "name": "mlp", "note": math.inf}}), ProfileError, "must hold only JSON values"),
    ("Profile.check_model: another model",
     lambda d: load_profile(d / "profile.json").check_model(resolve_workload("cnn").model),
     ProfileError, "the model is not the profiled model (mlp)"),
    ("load_cost_model: truncated", lambda d: load_cost_model(d / "truncated_profile.json"), ProfileError,
     "malformed JSON"),
    ("load_cost_model: another version", lambda d: load_cost_model(d / "old_model.json"), ProfileError,
     "saved by autotune 0.0.1"),
    ("load_cost_model: garbled coefficients", lambda d: load_cost_model(d / "garbled_model.json"),
     ProfileError, "malformed cost model"),
    ("resolve_workload: unknown", lambda d: resolve_workload("nosuch"), WorkloadError, "unknown workload"),
    ("resolve_workload: syntax error", lambda d: resolve_workload(f"{d}/syntax.py:make"), WorkloadError,
     "SyntaxError"),
    ("resolve_workload: sys.exit", lambda d: resolve_workload(f"{d}/exits.py:make"), WorkloadError,
     "SystemExit: 3"),
    ("Policy.save: under a file", lambda d: Policy().save(d / "a_file" / "p.json"), PolicyError,
     "cannot write policy"),
    ("Profile.save: missing directory", lambda d: load_profile(d / "profile.json").save(d / "nodir" / "p.json"),
     ProfileError, "cannot write profile"),
    ("EmulatedCluster: bad link", lambda d: EmulatedCluster(2, "fast"), ClusterError, "cannot parse link 'fast'"),
    ("EmulatedCluster: 0 hosts", lambda d: EmulatedCluster(0, "1gbit"), ClusterError, "hosts must be an int"),
]


@pytest.mark.parametrize("name,call,error,expect", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_raises_the_documented_error(
    d: Path, name: str, call: Callable[[Path], Any], error: type[AutotuneError], expect: str
) -> None:
    with pytest.raises(AutotuneError) as info:
        call(d)
    assert type(info.value) is error, f"{name}: raised {type(info.value).__name__}"
    message = str(info.value)
    assert "\n" not in message and expect in message, message
    assert not (d / "a_file" / "p.json").exists() and not (d / "nodir").exists()


def test_the_good_inputs_are_good(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rows above fail for the reason they name, not because the fixtures are broken."""
    policy = load_policy(d / "policy.json")
    assert policy.check(_mlp()).ok
    profile = load_profile(d / "profile.json")
    profile.check_model(_mlp())
    assert load_cost_model(d / "model.json").predict(policy).step_s > 0
    assert main(["simulate", str(d / "profile.json"), "--policy", str(d / "policy.json")]) == 0
    assert main(["show", str(d / "policy.json")]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", [-1.0, float("inf"), "3", True])
def test_patience_s_must_be_a_number_of_seconds(value: Any) -> None:
    from autotune.online.config import OnlineConfig

    with pytest.raises(AutotuneError, match="patience_s"):
        OnlineConfig(patience_s=value)
