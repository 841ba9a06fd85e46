"""The live trials' schedule (online/explore.py), driven by a simulated job: each step
takes the time of the policy it runs (with a little noise), as the controller would
report it at the next boundary."""

from __future__ import annotations

import random

import pytest

from autotune.online.explore import Contender, Exploration
from autotune.policies import Policy


def _contenders(times: dict[str, float], predicted: dict[str, float] | None = None) -> list[Contender]:
    """One contender per name (simplest first, as given), each a distinct policy."""
    out = []
    for i, name in enumerate(times):
        kind = "ddp" if name == "ddp" else "candidate"
        policy = Policy(bucket_cap_mb=float(i + 1))
        out.append(Contender(name, policy, kind, 0.0, (predicted or {}).get(name)))
    return out


def _run(exploration: Exploration, times: dict[str, float], noise: float = 0.02,
         most: int = 500, slow_steps: dict[str, list[int]] | None = None) -> list[str]:
    """Drive the trials to the end; the policy each step ran."""
    rng = random.Random(0)
    running = {0: exploration.current}
    ran: list[str] = []
    for step in range(most):
        name = running.get(step, running[step - 1] if step else exploration.current)
        running[step] = name
        last = None
        if step:
            prev = running[step - 1]
            extra = 3.0 if slow_steps and step - 1 in slow_steps.get(prev, []) else 1.0
            last = times[prev] * extra * (1 + rng.uniform(-noise, noise))
        switch = exploration.tick(step, last)
        if switch is not None:
            running[step + 1] = switch.name
        if exploration.done:
            return ran
        ran.append(name)
    raise AssertionError("the trials did not end")


TIMES = {"ddp": 1.0, "mid": 0.8, "fast": 0.5, "slow": 3.0}


def test_the_fastest_wins_and_becomes_the_policy_between_trials() -> None:
    exploration = Exploration(_contenders(TIMES, {"fast": 0.5, "mid": 0.8, "slow": 0.9}),
                              "ddp", trial_steps=2, budget_steps=60)
    ran = _run(exploration, TIMES)
    winner, decision = exploration.decide()
    assert winner.name == "fast"
    # once measured fastest, "fast" is A in A B A C: most trial steps run it, few run DDP
    assert ran.count("fast") > ran.count("ddp")
    assert ran.count("ddp") <= 2 * (exploration.trial_steps + 1) + 1
    assert exploration.steps <= 60


def test_a_far_slower_contender_is_cut_short_after_one_timed_step() -> None:
    exploration = Exploration(_contenders(TIMES), "ddp", trial_steps=4, budget_steps=80)
    ran = _run(exploration, TIMES)
    # its first timed step is seen at the next boundary, when the step after it has
    # already started under it (a switch is announced one step ahead)
    assert len(exploration.times["slow"]) == 2
    assert "cut short" in exploration.dropped["slow"]
    assert ran.count("slow") == 4  # its two settling steps (a first visit), two timed ones
    assert exploration.decide()[0].name == "fast"


def test_one_noisy_step_does_not_cut_a_contender_within_the_drift() -> None:
    times = {"ddp": 1.0, "fast": 0.7}
    exploration = Exploration(_contenders(times), "ddp", trial_steps=2, budget_steps=40,
                              abort_above=1.6)
    # a 1.5x CPU-drift step on "fast" (1.05 vs DDP's 1.0) stays under the abort line
    ran = _run(exploration, {"ddp": 1.0, "fast": 0.7}, noise=0.0)
    assert "fast" not in exploration.dropped and ran.count("fast") >= 2


def test_predicted_fastest_are_visited_first() -> None:
    times = {"ddp": 1.0, "a": 0.9, "b": 0.6, "c": 0.7}
    exploration = Exploration(_contenders(times, {"a": 0.9, "b": 0.6, "c": 0.7}), "ddp",
                              trial_steps=2, budget_steps=80)
    ran = _run(exploration, times)
    first = [n for i, n in enumerate(ran) if n != "ddp" and n not in ran[:i]]
    assert first[:1] == ["b"]
    assert exploration.decide()[0].name == "b"


def test_a_tie_goes_to_plain_ddp_and_the_budget_is_kept() -> None:
    times = {"ddp": 1.0, "same": 1.0}
    exploration = Exploration(_contenders(times), "ddp", trial_steps=2, budget_steps=30)
    _run(exploration, times, noise=0.05)
    assert exploration.decide()[0].name == "ddp"
    assert exploration.steps <= 30


@pytest.mark.parametrize("budget", [6, 7, 13])
def test_tiny_budgets_end_cleanly(budget: int) -> None:
    exploration = Exploration(_contenders(TIMES), "ddp", trial_steps=2, budget_steps=budget)
    _run(exploration, TIMES)
    assert exploration.steps <= budget
    exploration.decide()


def test_after_the_first_round_only_the_closest_go_on_and_get_the_budget() -> None:
    # seven contenders within 1.2x of each other: a block of every one per round would
    # spend the budget on two timed steps each; after round one only the three fastest
    # besides the incumbent are measured further
    times = {"ddp": 1.0, "a": 0.60, "b": 0.61, "c": 0.62, "d": 0.63, "e": 0.64, "f": 0.65,
             "g": 0.66}
    exploration = Exploration(_contenders(times), "ddp", trial_steps=2, budget_steps=90,
                              keep_after_first=3)
    _run(exploration, times, noise=0.01)
    kept = [n for n in times if n not in exploration.dropped and n != "ddp"]
    assert len(kept) <= 4 and "a" in kept
    assert all("behind 3 faster" in exploration.dropped[n] for n in ("e", "f", "g"))
    assert len(exploration.times["a"]) > 2 and all(len(exploration.times[n]) <= 2 for n in "efg")
    assert exploration.decide()[0].name == "a"


def test_one_method_at_two_bucket_sizes_is_decided_by_the_median_not_the_order() -> None:
    # psgd25 is listed first, but the two differ only in bucket size: equally simple,
    # so a tie within noise goes to the faster median (plain DDP still wins its ties)
    spec = {"compressor": "powersgd", "rank": 1}
    def psgd(cap: float) -> Policy:
        return Policy.from_dict({"version": 1, "default": spec, "bucket_cap_mb": cap})

    contenders = [Contender("ddp", Policy(), "ddp"),
                  Contender("psgd25", psgd(25.0), "baseline"),
                  Contender("psgd100", psgd(100.0), "baseline")]
    exploration = Exploration(contenders, "ddp", trial_steps=2, budget_steps=60)
    times = {"ddp": 1.0, "psgd25": 0.52, "psgd100": 0.50}
    _run(exploration, times, noise=0.08)
    winner, decision = exploration.decide()
    assert not decision.separated
    assert winner.name == "psgd100"


def test_a_dropped_contender_never_wins_a_tie_back() -> None:
    # "simple" (listed first, so simpler) measures 1.25x "fast" in its one block and is
    # dropped; its two steps would give an interval reaching 1, and a tie to the simpler
    times = {"ddp": 4.0, "simple": 1.25, "fast": 1.0}
    exploration = Exploration(_contenders(times), "ddp", trial_steps=2, budget_steps=60)
    _run(exploration, times, noise=0.1)
    assert "simple" in exploration.dropped
    winner, decision = exploration.decide()
    assert winner.name == "fast" and "simple" not in decision.medians
    # plain DDP, dropped too, still bounds the winner: its median is kept
    assert "ddp" in exploration.dropped and decision.medians["ddp"] > decision.medians["fast"]


def test_a_first_visit_settles_two_steps_and_later_visits_one() -> None:
    # the step after a contender's first switch loads what it first uses: a slow step
    # there is not timed, and does not cut the contender short
    times = {"ddp": 1.0, "fast": 0.5, "near": 0.52}
    exploration = Exploration(_contenders(times), "ddp", trial_steps=2, budget_steps=60)
    ran = _run(exploration, times, noise=0.0, slow_steps={"fast": [1, 2]})
    assert "fast" not in exploration.dropped and exploration.decide()[0].name == "fast"
    assert exploration.times["fast"][:2] == [0.5, 0.5]
    # "near", never the incumbent, runs in blocks: each settles one untimed step, and
    # its first block two
    blocks = sum(1 for i, n in enumerate(ran) if n == "near" and ran[i - 1] != "near")
    assert blocks >= 2
    assert ran.count("near") - len(exploration.times["near"]) == blocks + 1
