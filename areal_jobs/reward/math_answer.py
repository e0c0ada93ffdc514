"""Math rewards: extract a final answer, normalise it, and decide equivalence with the gold answer.

- Extraction (`extract_final_answer`): the last `\\boxed{...}` / `\\fbox{...}`; else the last GSM8K
  `#### <answer>` line; else the last "the answer is <answer>" or "Final Answer: <answer>" (so
  "Final Answer: The final answer is N. I hope it is correct." gives N). A prose answer ends at
  the first sentence end ('. ' or a final '.'), and markdown bold (`**N**`) is dropped. Nothing
  else: a response without a marked final answer is a parse error, so the policy cannot earn
  reward by merely mentioning the right number somewhere.
- Normalisation (`normalise_answer`): math-mode wrappers, spacing commands, `\\left`/`\\right`,
  `\\dfrac`, thousands separators, units (`\\text{cm}`, "dollars per week", `^\\circ`, `%`),
  trailing '.' and ';' and a leading `x =`. A trailing `!` is the factorial operator, never
  punctuation: `5!` is 120, and `4!` is not 4.
- Equivalence (`answers_match`): equal normalised strings; else exact rational arithmetic when both
  sides are plain numbers (integers, decimals, a/b, \\frac{a}{b}, n!: 0.5 == 1/2 but 0.333 != 1/3); else
  Hugging Face `math-verify` on both sides as LaTeX (symbolic: 2\\sqrt{2} == \\sqrt{8}, intervals,
  sets). Only its LaTeX parser is used: its plain-expression parser calls sympy's `parse_expr`,
  which evaluates Python and must never see model output.

math-verify bounds its own work with SIGALRM, which only works on a process's main thread (where
the reward workers call us); elsewhere we run it without that and rely on the service timeout.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction

from areal_jobs.api import RewardResult, RewardStatus

_VERIFY_TIMEOUT_S = 5  # per math-verify parse / compare; the service's reward.timeout_s is the backstop
_MAX_ANSWER_CHARS = 400  # longer "answers" are not answers; never hand them to the symbolic parser

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
# A prose final answer: "the answer is X" or "Final Answer: X"; the last one in the text wins.
# A lookahead, so overlapping matches are all found ("Final Answer: The final answer is 5").
_ANSWER_IS_RE = re.compile(r"(?=(?:answer\s+is|final\s+answer\s*:)\s*:?\s*([^\n]*))", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")  # '.' then a space or the end; "3.5" is not one
_BOLD_RE = re.compile(r"\*\*|__")
_FACTORIAL_RE = re.compile(r"^(\d{1,3})!$")
_MAX_FACTORIAL = 100
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")  # GSM8K calculator annotations: <<16-3-4=9>>
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:(,|\{,\}|\\,| )\d{3})+(?:\.\d+)?$")
_NUMBER_RE = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH_RE = re.compile(r"^(-?\d+)\s*/\s*(-?\d+)$")
# "18 dollars", "5 cm", "4 dollars per week", "60 km/h": keep the number. Letters only after it.
_UNIT_WORDS_RE = re.compile(r"^(-?[\d.,/]+)\s*([a-zA-Z]{2,}(?:\s*[\s/-]\s*[a-zA-Z]+)*)$")
_MATH_WORDS = {"pi", "sqrt", "infty", "inf", "frac", "cdot", "times", "and", "or", "to"}
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textrm)\s*\{([^{}]*)\}")
_ASSIGN_RE = re.compile(r"^[a-zA-Z]\s*=\s*(?=\S)")
_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad")


class VerifierTimeout(Exception):
    """The symbolic verifier ran past its time limit: reported as a timeout, never as a plain 0."""


def extract_final_answer(text: str) -> str | None:
    """The marked final answer of a response or solution, or None if it marks none."""
    boxed = (_last_boxed(text) or "").strip()
    if boxed:  # an empty \boxed{} marks nothing
        return boxed
    text = _CALCULATOR_RE.sub("", text)
    matches = _GSM8K_RE.findall(text)
    if matches and matches[-1].strip():
        return matches[-1].strip()
    return _prose_answer(text)


def _prose_answer(text: str) -> str | None:
    """The last "the answer is X" / "Final Answer: X", up to its sentence end, bold dropped."""
    matches = _ANSWER_IS_RE.findall(text)
    if not matches:
        return None
    answer = _BOLD_RE.sub("", matches[-1])
    answer = _SENTENCE_END_RE.split(answer, maxsplit=1)[0].strip()
    return answer or None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced, \\{ and \\} skipped) or \\boxed x."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": the token up to whitespace or '$'
        return re.split(r"[\s$]", text[i:], maxsplit=1)[0] or None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "\\":
            j += 2  # an escaped character, \{ or \} included, never changes the depth
            continue
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
        j += 1
    return None  # unbalanced: truncated response


def normalise_answer(answer: str) -> str:
    """Canonical string form of an extracted answer; equal strings are equivalent answers."""
    s = answer.strip()
    for _ in range(3):  # wrappers can nest: $\( x \)$
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
                s = s[len(left) : len(s) - len(right)].strip()
    for token in _DROP:
        s = s.replace(token, " " if token.startswith("\\q") else "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = _strip_text_units(s)
    s = s.strip().rstrip(".;").strip()  # not '!': a factorial
    s = _ASSIGN_RE.sub("", s)
    m = _UNIT_WORDS_RE.match(s)
    if m and m.group(2).split()[0].lower() not in _MATH_WORDS:  # "18 dollars", "5 cm": keep the number
        s = m.group(1)
    if _THOUSANDS_RE.match(s):
        s = re.sub(r",|\{,\}|\\,| ", "", s)
    s = re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # multiple choice "(C)" -> "C"
    return re.sub(r"\s+", " ", s).strip()


def _strip_text_units(s: str) -> str:
    """Drop \\text{...} units after a number ("5\\text{ cm}"); unwrap text answers ("\\text{Evelyn}")."""
    without = _TEXT_RE.sub("", s).strip()
    if without and re.search(r"\d", without):
        return without
    return _TEXT_RE.sub(lambda m: m.group(1), s)


def as_rational(s: str) -> Fraction | None:
    """Exact value of a normalised plain number (int, decimal, a/b, \\frac{a}{b}), else None."""
    s = s.replace(" ", "")
    if _NUMBER_RE.match(s):
        return Fraction(s)
    if (m := _FACTORIAL_RE.match(s)) and int(m.group(1)) <= _MAX_FACTORIAL:
        return Fraction(math.factorial(int(m.group(1))))
    for pattern in (_FRAC_RE, _SLASH_RE):
        if m := pattern.match(s):
            sign, num, den = m.groups() if pattern is _FRAC_RE else ("", *m.groups())
            if int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign else value
    return None


def answers_match(pred: str, gold: str) -> bool:
    """Is the extracted answer `pred` equivalent to `gold`? Raises VerifierTimeout."""
    p, g = normalise_answer(pred), normalise_answer(gold)
    if p == g:
        return True
    if not p or len(p) > _MAX_ANSWER_CHARS:
        return False
    p_num, g_num = as_rational(p), as_rational(g)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    return _symbolic_match(p, g)


def _symbolic_match(pred: str, gold: str) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    # SIGALRM (math-verify's timeout) can only be armed from the main thread.
    limit_s = _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    latex_only = [LatexExtractionConfig()]
    try:
        gold_parsed = parse(f"${gold}$", latex_only, parsing_timeout=limit_s, raise_on_error=True)
        pred_parsed = parse(f"${pred}$", latex_only, parsing_timeout=limit_s, raise_on_error=True)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=limit_s, raise_on_error=True))
    except TimeoutException as e:
        raise VerifierTimeout(str(e)[:200]) from e
    except Exception:  # noqa: BLE001  sympy / latex2sympy reject bad input in many ways: not equivalent
        return False


def reward_math(response: str, reference: str) -> RewardResult:
    """RewardFn for `math` and `gsm8k`. `reference` is the gold answer, or a gold solution that
    marks its answer (GSM8K's '#### 18', MATH's \\boxed{...})."""
    pred = extract_final_answer(response)
    if pred is None:
        return RewardResult(0.0, RewardStatus.parse_error, "no final answer (\\boxed{}, ####, 'answer is')")
    gold = extract_final_answer(reference) or reference
    try:
        ok = answers_match(pred, gold)
    except VerifierTimeout:
        return RewardResult(0.0, RewardStatus.timeout, "symbolic verifier timed out")
    return RewardResult(1.0 if ok else 0.0, RewardStatus.ok, "equivalent" if ok else "not equivalent")
