"""Profile JSON: round trips, strict validation naming the field, and `autotune profile`
end to end on real ranks."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from autotune.cli import main
from autotune.errors import ProfileError
from autotune.probes.profile import Profile, load_profile


def minimal() -> dict[str, Any]:
    """A small but complete profile of a two-parameter model on two ranks."""
    return {
        "version": 1,
        "env": {"torch": "2.13.0", "backend": "gloo", "device": "cpu", "world_size": 2,
                "hosts": 2, "link": "1gbit"},
        "workload": {"name": "tiny"},
        "network": {
            "fits": {
                "allreduce": {"latency_s": 1e-4, "bandwidth_Bps": 1.2e8, "busbw_Bps": 1.2e8},
                "p2p": {"inter": {"latency_s": 5e-5, "bandwidth_Bps": 1.2e8}},
            },
            "samples": [{"collective": "allreduce", "bytes": 4096, "times_s": [1e-4],
                         "median_s": 1e-4}],
        },
        "compute": {
            "step_s": [0.1, 0.11, 0.1], "forward_s": [0.03] * 3, "backward_s": [0.06] * 3,
            "optimizer_s": [0.01] * 3,
            "params": [
                {"name": "fc.weight", "shape": [10, 20], "numel": 200, "ready_s": 0.01},
                {"name": "fc.bias", "shape": [10], "numel": 10, "ready_s": 0.01},
            ],
        },
        "codecs": {"shapes": [], "errors": []},
    }


def test_round_trip_through_json_file(tmp_path: Path) -> None:
    profile = Profile.from_dict(minimal())
    path = tmp_path / "profile.json"
    profile.save(path)
    again = load_profile(path)
    assert again == profile
    # an optional array left empty is not written (codecs' shapes and errors here)
    assert again.to_dict() == {**minimal(), "calibration": {"results": []}, "codecs": {}}
    assert again.fingerprint == profile.fingerprint
    assert again.fit("p2p").bandwidth_Bps == 1.2e8
    assert again.compute_floor_s() == pytest.approx(0.1)


def test_profile_is_read_only_and_independent_of_its_source_dict() -> None:
    data = minimal()
    profile = Profile.from_dict(data)
    data["compute"]["step_s"].append(99.0)
    assert len(profile.compute.step_s) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.compute.step_s = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.compute.params[0].name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.codecs.structure["x"] = profile.codecs.structure  # type: ignore[index]


def _broken(path: list[Any], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(minimal())
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "path,value,field",
    [
        (["version"], 2, "version: expected 1, got 2"),
        (["env"], KeyError, "env: missing"),
        (["env", "world_size"], 0, "env.world_size: expected an integer >= 1"),
        (["env", "torch"], "", "env.torch"),
        (["network", "fits", "allreduce", "bandwidth_Bps"], -1.0, "network.fits.allreduce.bandwidth_Bps"),
        (["network", "fits", "p2p", "inter", "latency_s"], "fast", "network.fits.p2p.inter.latency_s"),
        (["network", "samples"], {}, "network.samples: expected an array"),
        (["compute", "step_s"], [], "compute.step_s: expected a non-empty array"),
        (["compute", "step_s", 1], float("nan"), "compute.step_s[1]"),
        (["compute", "params", 1, "shape"], [10, -1], "compute.params[1].shape"),
        (["compute", "params", 0, "name"], KeyError, "compute.params[0].name: missing"),
        (["compute", "params", 0, "dtype"], 32, "compute.params[0].dtype: expected a non-empty string"),
        (["network", "fits", "allreduce", "fit_bytes"], [4096, -1], "network.fits.allreduce.fit_bytes[1]"),
        (["extra"], 1, "extra: unknown key"),
    ],
)
def test_malformed_profiles_are_rejected_naming_the_field(path: list[Any], value: Any, field: str) -> None:
    with pytest.raises(ProfileError) as info:
        Profile.from_dict(_broken(path, value), source="p.json")
    assert f"p.json: {field}" in str(info.value)


def test_malformed_json_file_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"version": 1,\n "env": }')
    with pytest.raises(ProfileError, match=r"line 2, column 9"):
        load_profile(path)


def test_show_prints_a_profile_and_rejects_a_broken_one(tmp_path: Path, capsys) -> None:
    good = tmp_path / "good.json"
    Profile.from_dict(minimal()).save(good)
    assert main(["show", str(good)]) == 0
    out = capsys.readouterr().out
    assert "allreduce" in out and "fc.weight" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(["compute", "step_s"], [])))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compute.step_s" in err


def test_show_lists_a_parameter_that_never_got_a_gradient(tmp_path: Path, capsys) -> None:
    data = minimal()
    data["compute"]["params"][0]["ready_s"] = None  # an unused layer: valid, and shown
    Profile.from_dict(data).save(tmp_path / "p.json")
    assert main(["show", str(tmp_path / "p.json")]) == 0
    assert "fc.weight" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hosts", "2"], "--hosts 2 needs --link RATE"),
        (["--link", "1gbit"], "give --hosts 2 or more"),
        (["--workload", "nosuch"], "unknown workload 'nosuch'"),
        (["--budget-s", "-1"], "expected a positive number"),
        (["--out", "/nonexistent/dir/p.json"], "does not exist"),
    ],
)
def test_profile_bad_flags_fail_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.multirank
def test_autotune_profile_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "profile", "--workload", "mlp", "--nproc-per-node", "2",
         "--budget-s", "8", "--steps", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    profile = load_profile(out)
    assert profile.env.world_size == 2 and profile.workload.name == "mlp"
    assert {"allreduce", "allgather", "broadcast", "p2p"} <= set(profile.network.fits)
    assert len(profile.compute.params) == 10
    assert profile.codecs.shapes and profile.codecs.errors
    assert len(profile.calibration.results) == 8  # baselines and random policies
    assert "network" in proc.stdout and "codecs" in proc.stdout


# --- codec cells measured on rows ------------------------------------------------------


def with_rows() -> dict[str, Any]:
    """minimal() whose codec probe measured a large table on its rows: one time scaled
    from a row sample, errors exact on live rows, from a row sample, and one in full as
    profiles before row sampling wrote them (no ``measured``)."""
    data = minimal()
    data["compute"]["params"].append(
        {"name": "emb.weight", "shape": [400000, 16], "numel": 6_400_000, "ready_s": 0.02})
    fp16, int8 = {"compressor": "fp16"}, {"compressor": "int8"}
    data["codecs"] = {
        "world_size": 2, "grid": [fp16, int8], "skipped": [],
        "shapes": [
            {"spec": fp16, "shape": [400000, 16], "encode_decode_s": 0.008, "wire_bytes": 12800000,
             "measured": "sample", "sample": {"param": "emb.weight", "rows": 16384,
                                              "numel": 262144, "encode_decode_s": 0.0003}},
            {"spec": int8, "shape": [400000, 16], "encode_decode_s": 0.3, "wire_bytes": 6425000,
             "measured": "full", "reps": 1},
            {"spec": fp16, "shape": [10, 20], "encode_decode_s": 1e-5, "wire_bytes": 400},
        ],
        "errors": [
            {"spec": fp16, "param": "emb.weight", "rel_error": 0.02, "cum_error": 0.02,
             "measured": "live_rows", "sample": {"rows": 2020, "of_rows": 400000, "numel": 32320}},
            {"spec": int8, "param": "emb.weight", "rel_error": 0.008, "cum_error": 0.007,
             "measured": "sample", "sample": {"rows": 16384, "of_rows": 400000, "numel": 262144,
                                              "live_rows": 83, "of_live_rows": 2020,
                                              "energy_ratio": 0.76}},
            *({"spec": spec, "param": name, "rel_error": 0.001, "cum_error": 0.001}
              for spec in (fp16, int8) for name in ("fc.weight", "fc.bias")),
        ],
        "sampling": {"above": 1048576, "numel": 262144, "min_live_rows": 64,
                     "representative": 0.1},
        "structure": {
            "emb.weight": {"row_density_mean": 0.0012, "row_density_max": 0.0015,
                           "row_density_std": 0.0002, "steps": 4, "ranks": 2},
            **{name: {"row_density_mean": 1.0, "row_density_max": 1.0, "row_density_std": 0.0,
                      "steps": 4, "ranks": 2} for name in ("fc.weight", "fc.bias")},
        },
    }
    return data


def test_cells_measured_on_rows_load_and_old_cells_read_as_full() -> None:
    profile = Profile.from_dict(with_rows())
    assert [e.measured or "full" for e in profile.codecs.errors] == [
        "live_rows", "sample", "full", "full", "full", "full"]
    assert Profile.from_dict(profile.to_dict()) == profile


def _codecs_broken(path: list[Any], value: Any) -> dict[str, Any]:
    data = with_rows()
    target = data["codecs"]
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "path,value,field",
    [
        (["errors", 1, "measured"], "guessed", "codecs.errors[1].measured: expected one of 'full'"),
        (["errors", 1, "sample"], KeyError, "codecs.errors[1].sample: missing"),
        (["errors", 1, "sample", "rows"], 500000, "codecs.errors[1].sample.rows: expected an integer in [1, 400000]"),
        (["errors", 0, "sample", "numel"], 0, "codecs.errors[0].sample.numel"),
        (["errors", 1, "sample", "energy_ratio"], -1.0, "codecs.errors[1].sample.energy_ratio"),
        (["shapes", 0, "measured"], "live_rows", "codecs.shapes[0].measured: expected one of 'full', 'sample'"),
        (["shapes", 0, "sample", "encode_decode_s"], float("inf"), "codecs.shapes[0].sample.encode_decode_s"),
        (["shapes", 0, "sample", "param"], "", "codecs.shapes[0].sample.param"),
        (["sampling", "above"], 0, "codecs.sampling.above"),
        (["skipped"], [{"compressor": "zip"}], "codecs.skipped[0]: unknown compressor 'zip'"),
        (["structure"], {"emb.weight": {"row_density_max": 1.5}},
         "codecs.structure['emb.weight'].row_density_max: expected a number >= 0 and <= 1"),
        (["structure"], {"emb.weight": 0.1}, "codecs.structure['emb.weight']: expected an object"),
        (["structure", "emb.weight", "row_density_max"], KeyError,
         "codecs.structure['emb.weight'].row_density_max: missing"),
        (["structure", "emb.weight", "row_density_mean"], 0.002,
         "codecs.structure['emb.weight'].row_density_mean: 0.002 is above row_density_max 0.0015"),
        (["structure", "emb.weight", "row_density_mean"], -0.1,
         "codecs.structure['emb.weight'].row_density_mean: expected a number >= 0 and <= 1"),
        (["structure", "emb.weight", "row_density_std"], 0.7,
         "codecs.structure['emb.weight'].row_density_std: expected a number >= 0 and <= 0.5"),
        (["structure", "emb.weight", "row_density_std"], "wide",
         "codecs.structure['emb.weight'].row_density_std: expected a number"),
        (["structure", "emb.weight", "steps"], 0,
         "codecs.structure['emb.weight'].steps: expected an integer >= 1"),
        (["structure", "emb.weight", "ranks"], 3,
         "codecs.structure['emb.weight'].ranks: expected an integer in [1, 2]"),
        (["structure", "nosuch.weight"], {"row_density_max": 0.5},
         "codecs.structure['nosuch.weight']: not a profiled parameter"),
        (["shapes", 1, "row_density"], 1.5, "codecs.shapes[1].row_density: expected a number"),
        # a cell timed again in full keeps the sample it was first timed on
        (["shapes", 1, "sample"], {"rows": 5}, "codecs.shapes[1].sample.param: missing"),
    ],
)
def test_malformed_row_cells_are_rejected_naming_the_field(path: list[Any], value: Any, field: str) -> None:
    with pytest.raises(ProfileError) as info:
        Profile.from_dict(_codecs_broken(path, value), source="p.json")
    assert f"p.json: {field}" in str(info.value)


def test_show_says_how_many_cells_were_extrapolated_and_how_many_are_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.json"
    Profile.from_dict(with_rows()).save(path)
    assert main(["show", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert ("1 of 6 error cells extrapolated from row samples (energy ratio 0.76-0.76), "
            "1 exact on live rows; 1 of 3 encode+decode times scaled from row samples") in out
    assert "missing" not in out
    # a profile whose probe ran out of budget (written before row sampling) says what is missing
    data = with_rows()
    data["codecs"]["skipped"] = [{"compressor": "sign"}]
    data["codecs"]["truncated"] = True
    for row in data["codecs"]["shapes"] + data["codecs"]["errors"]:
        row.pop("measured", None)
        row.pop("sample", None)
    Profile.from_dict(data).save(path)
    assert main(["show", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "codec probe stopped at its time budget: 3 cells missing (sign not measured)" in out
    assert "extrapolated" not in out


def test_show_lists_the_row_sparse_gradients_or_says_all_are_dense(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.json"
    Profile.from_dict(with_rows()).save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    table = out.split("row-sparse gradients")[1]
    row = next(line for line in table.splitlines() if "emb.weight" in line)
    assert [cell.strip() for cell in row.split("│")[1:-1]] == [
        "emb.weight", "400000x16", "0.12%", "0.15%", "0.02%"]  # mean, busiest, spread
    assert "fc.weight" not in table
    assert "share of rows holding a non-zero value, over 4 steps x 2 rank(s)" in " ".join(
        table.split()) and "2 dense" in table
    # every gradient dense: one line; a profile from before the measurement: nothing
    data = with_rows()
    data["codecs"]["structure"]["emb.weight"].update(
        row_density_mean=0.9, row_density_max=0.95, row_density_std=0.01)
    Profile.from_dict(data).save(path)
    assert main(["show", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "gradient rows: all 3 gradients measured are dense" in out
    assert "row-sparse" not in out
    del data["codecs"]["structure"]
    Profile.from_dict(data).save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gradient rows" not in out and "row-sparse" not in out


# ------------------------------------------------------------ typed sections

def test_each_section_is_typed_validated_and_round_trips() -> None:
    from autotune.probes.profile import Codecs, Compute, Env, Network, Workload

    profile = Profile.from_dict(minimal())
    assert isinstance(profile.env, Env) and profile.env.world_size == 2 and profile.env.link == "1gbit"
    assert isinstance(profile.workload, Workload) and profile.workload.spec is None
    assert isinstance(profile.network, Network) and profile.network.fits["allreduce"].latency_s == 1e-4
    assert isinstance(profile.compute, Compute) and profile.compute.param_names == ("fc.weight", "fc.bias")
    assert profile.compute.shapes == {"fc.weight": (10, 20), "fc.bias": (10,)}
    assert isinstance(profile.codecs, Codecs) and profile.codecs.structure == {}
    for section in (profile.env, profile.workload, profile.network, profile.compute,
                    profile.codecs, profile.calibration):
        assert type(section).from_dict(section.to_dict()) == section
    # descriptive keys autotune does not read are kept, read-only, and written back
    data = minimal()
    data["env"]["created"] = "2026-12-04T00:00:00+00:00"
    env = Profile.from_dict(data).env
    assert env.extra["created"] == data["env"]["created"]
    assert env.to_dict() == data["env"]


def test_records_inside_sections_are_typed_and_written_back_as_read() -> None:
    from autotune.probes.profile import (
        CalibrationRun, CodecError, NetworkFit, ProfiledParam, RowSample, RowStructure)

    profile = Profile.from_dict(with_rows())
    weight = profile.compute.params[0]
    assert isinstance(weight, ProfiledParam) and (weight.name, weight.shape, weight.ready_s) == (
        "fc.weight", (10, 20), 0.01)
    assert weight.extra == {"numel": 200}  # descriptive: kept, read-only
    assert isinstance(profile.fit("allreduce"), NetworkFit) and profile.fit("p2p").latency_s == 5e-5
    sampled = profile.codecs.errors[1]
    assert isinstance(sampled, CodecError) and isinstance(sampled.sample, RowSample)
    assert (sampled.measured, sampled.sample.energy_ratio, sampled.sample.extra["live_rows"]) == (
        "sample", 0.76, 83)
    assert isinstance(profile.codecs.structure["emb.weight"], RowStructure)
    assert profile.codecs.structure["emb.weight"].row_density_max == 0.0015
    # a record is written back key for key, nulls and the file's order included
    record = {"ready_order": 3, "name": "w", "ready_s": None, "shape": [2], "dtype": "float32"}
    assert list(ProfiledParam.from_dict(record).to_dict().items()) == list(record.items())
    assert list(Profile.from_dict(profile.to_dict()).to_dict()["codecs"]["errors"][1]) == list(
        with_rows()["codecs"]["errors"][1])
    # built in code: the fields set, and a plain-DDP run's null policy
    assert CalibrationRun(step_s=0.2, source="verify").to_dict() == {
        "policy": None, "step_s": 0.2, "source": "verify"}


@pytest.mark.parametrize("build,field", [
    (lambda: __import__("autotune.probes.profile", fromlist=["Compute"]).Compute(
        step_s=(), forward_s=(0.1,), backward_s=(0.1,), optimizer_s=(0.1,),
        params=({"name": "w", "shape": [2]},)), "compute.step_s: expected a non-empty array"),
    (lambda: __import__("autotune.probes.profile", fromlist=["Env"]).Env(
        torch="2.13.0", backend="gloo", device="cpu", world_size=2), "env.hosts: missing"),
    (lambda: __import__("autotune.probes.profile", fromlist=["Env"]).Env(
        torch="2.13.0", backend="gloo", device="cpu", world_size=2, hosts=3),
     "env.hosts: expected an integer in [1, 2]"),
    (lambda: __import__("autotune.probes.profile", fromlist=["Workload"]).Workload(
        name="x", spec=""), "workload.spec: expected a non-empty string"),
    (lambda: __import__("autotune.probes.profile", fromlist=["Calibration"]).Calibration(
        results=(__import__("autotune.probes.profile", fromlist=["CalibrationRun"]).CalibrationRun(
            step_s=-1.0),)), "calibration.results[0].step_s: expected a number > 0"),
])
def test_a_section_built_in_code_is_validated_like_one_read_from_a_file(build, field: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(field)):
        build()


# the sections whose arrays and objects hold records (Entry)
ENTRY_SECTIONS = {"network", "compute", "codecs", "calibration"}


def _string_key_reads(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.AST, Any]]:
    """(node, what it reads, the key) of each ``x["key"]`` and ``x.get("key")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            yield node, node.value, node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)):
            yield node, node.func.value, node.args[0].value


def _profile_reads(tree: ast.AST, fields: set[str]) -> list[int]:
    """Lines of ``tree`` that read a field of a profile's record by string key
    (``p["ready_s"]``, ``s.get("denser")``): on a record reached from a section
    (``profile.compute.params[0]["name"]``) or from a name bound to one in the same
    function (``for p in profile.compute.params``, ``fit = profile.fit("p2p")``,
    ``modules = {m.name: m for m in c.modules}``, ...)."""

    def records(expr: ast.AST, bound: set[str]) -> bool:
        """Whether ``expr`` is a record of a profile or a collection of them."""
        if isinstance(expr, ast.Name):
            return expr.id in bound
        if isinstance(expr, ast.Attribute):
            return expr.attr in ENTRY_SECTIONS or records(expr.value, bound)
        if isinstance(expr, (ast.Subscript, ast.Starred)):
            return records(expr.value, bound)
        if isinstance(expr, ast.Call):
            f, args = expr.func, expr.args
            if isinstance(f, ast.Attribute) and f.attr == "fit":  # Profile.fit
                return isinstance(f.value, ast.Name) and "prof" in f.value.id
            if isinstance(f, ast.Attribute) and f.attr in ("get", "items", "values"):
                return records(f.value, bound)
            return (isinstance(f, ast.Name) and f.id in ("iter", "list", "next", "sorted", "tuple")
                    and bool(args) and records(args[0], bound))
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return any(records(e, bound) for e in expr.elts)
        if isinstance(expr, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return records(expr.elt, bound)
        if isinstance(expr, ast.DictComp):
            return records(expr.value, bound)
        if isinstance(expr, ast.IfExp):
            return records(expr.body, bound) or records(expr.orelse, bound)
        if isinstance(expr, ast.BoolOp):
            return any(records(v, bound) for v in expr.values)
        return False

    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    top = [n for n in getattr(tree, "body", [])
           if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = set()
    for scope in [ast.Module(body=top, type_ignores=[]), *functions]:
        bound: set[str] = set()
        while True:  # names bound to records, and names bound from those, ...
            before = len(bound)
            for node in ast.walk(scope):
                if isinstance(node, (ast.For, ast.comprehension)):
                    pairs = [(node.target, node.iter)]
                elif isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    pairs = [(node.target, node.value)]
                else:
                    continue
                for target, value in pairs:
                    if records(value, bound):
                        bound |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if len(bound) == before:
                break
        found |= {node.lineno for node, target, key in _string_key_reads(scope)
                  if key in fields and records(target, bound)}
    return sorted(found)


def test_consumers_read_profile_sections_as_attributes_not_string_keys() -> None:
    """JSON stays at the file edge: outside probes/profile.py nothing indexes a profile's
    section with a string (``profile.compute["params"]``, ``profile.env.get("link")``),
    nor a record inside one (``p["ready_s"]`` of ``profile.compute.params``,
    ``fit.get("busbw_Bps")``)."""
    from autotune.probes.profile import Entry

    fields = {f.name for kind in Entry.__subclasses__() for f in dataclasses.fields(kind)}
    fields -= {"extra", "_keys"}
    assert {"ready_s", "encode_decode_s", "latency_s", "row_density_max", "step_s"} <= fields
    sections = {"env", "workload", "network", "compute", "codecs", "calibration"}
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in [*(root / "autotune").rglob("*.py"), *(root / "bench").rglob("*.py")]:
        if path.name == "profile.py" and path.parent.name == "probes":
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root)
        found += [f"{where}:{node.lineno} (section)" for node, target, _ in _string_key_reads(tree)
                  if isinstance(target, ast.Attribute) and target.attr in sections
                  and isinstance(target.value, ast.Name) and "prof" in target.value.id]
        found += [f"{where}:{line} (entry)" for line in _profile_reads(tree, fields)]
    assert not found, f"string-key reads of profile sections or their entries: {found}"
