"""stdin/stdout grading through the real service, on a small problem set written for these tests:
every reference solution passes, every empty or wrong program fails."""

from __future__ import annotations

import json

from areal_jobs.api import RewardRequest, RewardStatus

# name -> (test cases as (input, expected output), a correct program, a wrong program)
PROBLEMS: dict[str, tuple[list[tuple[str, str]], str, str]] = {
    "a_plus_b": (
        [("1 2\n", "3\n"), ("-5 5\n", "0\n"), ("1000000000 1000000000\n", "2000000000\n")],
        "a, b = map(int, input().split())\nprint(a + b)\n",
        "a, b = map(int, input().split())\nprint(a - b)\n",
    ),
    "reverse_lines": (
        [("3\na\nb\nc\n", "c\nb\na\n"), ("1\nonly\n", "only\n")],
        "import sys\nn, *rows = sys.stdin.read().split('\\n')\nprint('\\n'.join(rows[: int(n)][::-1]))\n",
        "import sys\nn, *rows = sys.stdin.read().split('\\n')\nprint('\\n'.join(rows[: int(n)]))\n",
    ),
    "fibonacci": (
        [("0\n", "0\n"), ("1\n", "1\n"), ("10\n", "55\n"), ("90\n", "2880067194370816120\n")],
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
        "n = int(input())\nprint(n * (n - 1) // 2)\n",  # right for n <= 1 only
    ),
    "sort_numbers": (
        [("5\n3 1 4 1 5\n", "1 1 3 4 5\n"), ("1\n7\n", "7\n")],
        "input()\nprint(*sorted(map(int, input().split())))\n",
        "input()\nprint(*map(int, input().split()))\n",
    ),
    "count_words_big_input": (
        [(("word " * 40_000) + "\n", "40000\n")],  # 200 KB of stdin
        "import sys\nprint(len(sys.stdin.read().split()))\n",
        "import sys\nprint(len(sys.stdin.readline()))\n",
    ),
    "grid_sum_trailing_spaces": (
        [("2 2\n1 2\n3 4\n", "3 \n7   \n\n\n")],  # trailing spaces and blank lines do not matter
        "r, c = map(int, input().split())\nfor _ in range(r):\n    print(sum(map(int, input().split())))\n",
        "r, c = map(int, input().split())\nprint(r * c)\n",
    ),
}


def _reference(cases: list[tuple[str, str]]) -> str:
    return json.dumps({"tests": [{"input": i, "output": o} for i, o in cases]})


def test_reference_solutions_pass_and_empty_or_wrong_programs_fail(scorer) -> None:
    requests, expected = [], []
    for name, (cases, good, bad) in PROBLEMS.items():
        for label, program, reward in (("good", good, 1.0), ("wrong", bad, 0.0), ("empty", "pass\n", 0.0)):
            requests.append(RewardRequest("code_stdio", program, _reference(cases)))
            expected.append((name, label, reward))
    results = scorer.score(requests)
    mismatches = [(*e, r.detail) for e, r in zip(expected, results, strict=True) if r.reward != e[2]]
    assert mismatches == []
    assert all(r.status is RewardStatus.ok for r in results)


def test_fenced_program_and_failure_details(scorer) -> None:
    cases, good, _ = PROBLEMS["a_plus_b"]
    fenced = f"Read both numbers:\n```python\n{good}```\nDone."
    crash = "raise SystemExit(2)\n"
    partial = "a, b = map(int, input().split())\nprint(3)\n"  # passes test 1 only
    results = scorer.score(
        [RewardRequest("code_stdio", p, _reference(cases)) for p in (fenced, crash, partial)]
    )
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert results[0].detail == "passed 3 tests"
    assert results[1].detail == "test 1/3: exit status 2"
    assert results[2].detail == "test 2/3: wrong answer"


def test_time_limit_is_a_timeout_status(scorer) -> None:
    cases, _, _ = PROBLEMS["a_plus_b"]
    [result] = scorer.score([RewardRequest("code_stdio", "import time\ntime.sleep(30)\n", _reference(cases))])
    assert (result.reward, result.status) == (0.0, RewardStatus.timeout)
