"""One check per kind of thing a doc shows, and `findings`: every problem of a kind, as messages."""

from __future__ import annotations

import os
import re

from docs_check.makefile import make_expand, makefile
from docs_check.markdown import commands, docs, snippets, split_doc, tokens
from docs_check.overrides import (
    OVERRIDE_RE,
    check_override,
    config_schema,
    key_known,
    override_root_is_config,
)
from docs_check.tree import (
    basenames,
    class_files,
    code_words,
    defined_tests,
    defines,
    dir_names,
    extensions,
    is_hydra,
    is_output,
    module_file,
    module_flags,
    module_source_file,
    path_exists,
    py_source,
    python_roots,
    repo_files,
    roots,
)

# Genuine exceptions, each with its reason: (doc, text shown) -> why it may stay.
ALLOWED: dict[tuple[str, str], str] = {
    ("*", "sbatch/squeue/scancel"): "the three SLURM client commands, not a path",
    ("*", "gpu_trainer.md"): "written by `python -m bench.trainer.gpu_trainer` to its --out, not shipped",
    ("*", "pilot.md"): "written by `make ablate ABLATE=pilot` to its --out, not shipped",
    ("docs/slurm.md", "cluster.nodse=64"): "the misspelt key that the text shows being refused",
    ("docs/slurm.md", "+cluster.nodse=64"): "the same misspelt key, in Hydra's other spelling",
    ("docs/architecture.md", "launch.plan"): "names the module of a former import cycle (history)",
    ("docs/architecture.md", "launch.plan_allocation"): "the other half of that former cycle (history)",
    ("*", "rewards.py"): "the user's own reward file, named as an example",
    ("*", "file.py"): "a user's file in the `file.py:fn` spec of a reward function",
    ("*", "path.py"): "a user's file in the `path.py:fn` spec of a reward function",
    ("docs/your-task.md", "ppo_trainer.yaml"): "verl's config file, in the table beside its settings",
}

HYDRA_FLAGS = {  # Hydra's own command-line flags (hydra/_internal/utils.py get_args_parser)
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
    "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp",
    "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info", "-i",
}  # fmt: skip
PATH_EXTS = (".py", ".md", ".yaml", ".yml", ".sbatch", ".txt", ".toml", ".cfg", ".jinja", ".json")


def check_module_args(module: str, args: list[str]) -> list[str]:
    """What is wrong with `python -m module args` (an empty list when nothing)."""
    root = module.split(".")[0]
    if root not in python_roots():
        return []  # pytest, pip, vllm...: not ours
    if module.endswith("*"):
        return []
    if module_file(module) is None:
        return [
            f"`python -m {module}`: no {module.replace('.', '/')}.py or {module.replace('.', '/')}/__main__.py in the repository"
        ]
    problems = []
    hydra = is_hydra(module)
    flags = HYDRA_FLAGS if hydra else module_flags(module)
    for a in args:
        if re.match(r"^--?[A-Za-z]", a):
            flag = a.split("=", 1)[0]
            if flag not in flags:
                accepted = ", ".join(sorted(f for f in flags if f.startswith("--") and f != "--help"))
                kind = (
                    "Hydra takes overrides (key=value), not"
                    if hydra
                    else f"its options: {accepted or 'none'}; not"
                )
                problems.append(f"`python -m {module}` has no option `{flag}` ({kind} `{flag}`)")
        elif hydra and "=" in a and "<" not in a.split("=")[0]:
            problem = check_override(a) if OVERRIDE_RE.match(a) else f"`{a}` is not a Hydra override"
            if problem:
                problems.append(f"`python -m {module} ... {a}`: {problem}")
    return problems


def check_make(words: list[str]) -> list[str]:
    mk = makefile()
    targets = [w for w in words if "=" not in w and not w.startswith("-")]
    given = dict(w.split("=", 1) for w in words if "=" in w and re.match(r"^[A-Za-z_]\w*=", w))
    problems = []
    for t in targets:
        if "<" in t or t in ("...", "…"):
            continue
        if t not in mk.targets:
            problems.append(
                f"`make {t}`: the Makefile has no target `{t}` (targets: {', '.join(sorted(mk.targets))})"
            )
    for var in given:
        if var not in mk.variables:
            problems.append(f"`make ... {var}=`: the Makefile has no variable `{var}`")
    for t in targets:  # the command the recipe runs, with the variables given
        for recipe in mk.recipes.get(t, []):
            m = re.search(r"(?:^|\s)-m\s+(\S+)(.*)$", make_expand(recipe, given, t))
            if not m or m.group(1).startswith("\x00"):
                continue
            args = []
            for w in m.group(2).split():
                parts = re.split(r"\x00(\w+)\x00", w)
                if len(parts) == 3 and parts[0] == parts[2] == "":
                    args += tokens(given[parts[1]])
                else:
                    args.append("".join(given.get(p, p) if i % 2 else p for i, p in enumerate(parts)))
            problems += [f"{p} (through `make {t}`)" for p in check_module_args(m.group(1), args)]
            break
    return problems


PATH_RE = re.compile(r"(?<![\w/.\-~$:@<*])((?:[\w.\-]+|\{[^}\n]*\})(?:/(?:[\w.\-*<>…]|\{[^}\n]*\})*)+)")
DOTTED_RE = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+)(?::(\w+))?(?:\(\))?$")


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [
        x
        for alt in m.group(1).split(",")
        for x in expand_braces(path[: m.start()] + alt.strip() + path[m.end() :])
    ]


DEV_PATH_RE = re.compile(r"(?<![\w.])/(?:work|root|home)/[^\s`'\")]*")
# a developer machine's folders (the workspace, root's home, a home): no user has them; a path
# that leaves the checkout (../shared/...) is refused by check_path
FILE_NAME_RE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|yaml|sbatch|md|txt))\b")  # e2e_bench.py
PLACEHOLDER_RE = re.compile(r"^\s*(?:TODO|TBD|FIXME|XXX|[A-Z][A-Z_]{2,})\s*$")  # a line that is one bare word


def check_path(path: str, base: str = "") -> str | None:
    """What is wrong with a repository path shown in a doc; `base` is the folder it is relative to
    ("" for the repository root: commands; the doc's folder: links)."""
    path = path.rstrip(".,:;").split("::")[0]
    first = path.split("/")[0]
    if (
        first == "runs"
        or any(c in path for c in "<>…")
        or "..." in path
        or first.isupper()
        or first.startswith("$")
    ):
        return None
    if first in ("..", "."):
        resolved = os.path.normpath(os.path.join(base, path))
        if resolved.startswith(".."):
            return f"`{path}` is a path outside the repository (no user has it): name it in words or drop it"
        return (
            None if path_exists(resolved) or is_output(resolved) else f"`{path}` ({resolved}) does not exist"
        )
    for p in expand_braces(path):
        p = p.strip("/") + ("/" if p.endswith("/") else "")
        if first in roots() and first + "/" in repo_files():
            if path_exists(p) or is_output(p) or p + ".py" in repo_files():
                continue
            stem, dot, attr = p.rpartition("/")[2].partition(".")
            module = p.rpartition("/")[0] + "/" + stem + ".py"
            if (
                dot and module in repo_files() and attr.isidentifier()
            ):  # launch/planning/fit/memory.GpuOverheads
                if not defines(py_source(module), attr.split(".")[0], anywhere=True):
                    return f"`{p}`: {module} defines no `{attr}`"
                continue
            return f"`{p}` does not exist in the repository"
        elif (
            p.endswith(PATH_EXTS)
            and "/" in p
            and (first in dir_names() or p.endswith(".md"))
            and not is_output(p)
        ):
            # a path inside a package (rollout/server.py), or a doc: some file of the repository ends
            # with it (another project's source, SGLang's srt/..., is left alone)
            if not any(f == p or f.endswith("/" + p) for f in repo_files()):
                return f"`{p}` is not a file of the repository (no path ends with it)"
    return None


def check_names(span: str) -> str | None:
    """A dotted module path (areal_jobs.x.y, launch.z:fn), a Class.attribute, or an environment or
    make variable (VLLM_VENV) shown in code."""
    if re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+", span) and span not in code_words():
        return f"`{span}`: no file of the repository (code, Makefile, conf/) names it"
    m = DOTTED_RE.match(span)
    if not m:
        return None
    dotted, attr = m.group(1), m.group(2)
    parts = dotted.split(".")
    if not attr and key_known(dotted):  # a configuration key (launch.dry_run), not a module
        return None
    if parts[0] in python_roots():
        for cut in range(len(parts), 0, -1):
            rel = module_source_file(".".join(parts[:cut]))
            if rel is None:
                continue
            rest = parts[cut:] + ([attr] if attr else [])
            src = "" if rel.endswith("/") else py_source(rel)
            if rest and not defines(src, rest[0]):
                if rel.endswith(("/", "__init__.py")):
                    where = rel.rsplit("/", 1)[0] if rel.endswith("__init__.py") else rel.rstrip("/")
                    return (
                        f"`{span}`: no module `{'.'.join(parts[:cut] + rest[:1])}` "
                        f"(no {where}/{rest[0]}.py or {where}/{rest[0]}/), nor a name `{rest[0]}` in {rel}"
                    )
                return f"`{span}`: {rel} defines no `{rest[0]}`"
            if len(rest) > 1 and src and not defines(src, rest[1], anywhere=True):
                return f"`{span}`: {rel} defines no `{rest[1]}`"
            return None
        return None
    if len(parts) == 2 and re.match(r"^[A-Z]\w*[a-z]\w*$", parts[0]):
        files = class_files().get(parts[0])
        if files and not any(defines(py_source(f), parts[1], anywhere=True) for f in files):
            return f"`{span}`: class {parts[0]} ({', '.join(files)}) has no `{parts[1]}`"
    keys, _ = config_schema()
    # module-relative names are checked for classes only (`sglang_client.SGLangClient`): a lower-case
    # pair is as often a field path of someone's schema (verl's reward_model.ground_truth)
    if (
        len(parts) == 2
        and parts[1][:1].isupper()
        and parts[0] not in {k.split(".")[0] for k in keys}
        and parts[1] not in extensions()
    ):
        # module-relative (`sglang_client.SGLangClient`): a module of that name defines it
        files = [f for f in repo_files() if f.endswith("/" + parts[0] + ".py")]
        if files and not any(defines(py_source(f), parts[1], anywhere=True) for f in files):
            return f"`{span}`: {', '.join(files)} defines no `{parts[1]}`"
    return None


TEST_NAME_RE = re.compile(r"(?<![\w/.:-])(test_\w+)(?!\w)(\.\.\.|\.py)?")  # `test_x[case]`, `test_x_...`


def check_test_names(text: str) -> list[tuple[str, str]]:
    """(name, problem) for each test named in `text` that tests/ does not define (`test_x_...`: a
    test whose name starts so)."""
    out = []
    for m in TEST_NAME_RE.finditer(text):
        name, rest = m.groups()
        if rest == ".py":
            continue  # a file: the path checks have it
        tests = defined_tests()
        if not (any(d.startswith(name) for d in tests) if rest == "..." else name in tests):
            out.append((name, f"`{name}`: no test function of tests/ has this name"))
    return out


def findings(kind: str) -> list[str]:
    """Every problem of one kind (make, python, override, names, path) in every doc, as messages."""
    out: list[str] = []

    def add(snip_doc: str, line: int, shown: str, problem: str | None) -> None:
        if problem and (snip_doc, shown) not in ALLOWED and ("*", shown) not in ALLOWED:
            msg = f"{snip_doc}:{line}: {problem}"
            if msg not in out:
                out.append(msg)

    shell_vars: dict[str, dict[str, str]] = {}
    for snip in snippets():
        cmds = list(commands(snip, shell_vars.setdefault(snip.doc, {})))
        if kind == "make":
            for tool, words in cmds:
                if tool == "make":
                    for p in check_make(words):
                        add(snip.doc, snip.line, " ".join(words), p)
        elif kind == "python":
            for tool, words in cmds:
                if tool == "python" and words:
                    for p in check_module_args(words[0], words[1:]):
                        add(snip.doc, snip.line, words[0], p)
        elif kind == "override":
            if "launch.simulate" in snip.text:  # the simulator's keys are its profile's (sim/profile.py)
                continue
            for w in tokens(snip.text):
                for part in re.findall(r"""OVERRIDES=["']?(.*)""", w) or [w]:
                    for tok in tokens(part):
                        m = OVERRIDE_RE.match(tok)
                        if m and override_root_is_config(m.group(2)):
                            add(snip.doc, snip.line, tok, check_override(tok))
        elif kind == "names":
            add(snip.doc, snip.line, snip.text, check_names(snip.text))
            for name, problem in check_test_names(snip.text):
                add(snip.doc, snip.line, name, problem)
    if kind == "path":
        # the help text `python -m launch.submit --help` prints lives in conf/ (hydra.help)
        for f in sorted(x for x in repo_files() if x.startswith("conf/") and x.endswith(".yaml")):
            for line, text in enumerate(py_source(f).splitlines(), 1):
                for m in PATH_RE.finditer(text):  # comments are prose: "launch/scheduler overhead"
                    if m.group(1).rstrip(".,:;").endswith(("/", *PATH_EXTS)):
                        add(f, line, m.group(1), check_path(m.group(1)))
        for doc in docs():
            code, prose = split_doc(doc)
            # commands run from the repository root; prose and links are read beside the doc
            sources = [(s.line, s.text, "") for s in code]
            sources += [(i, text, os.path.dirname(doc)) for i, text in enumerate(prose.splitlines(), 1)]
            for line, text, base in sources:
                for m in PATH_RE.finditer(text):
                    add(doc, line, m.group(1), check_path(m.group(1), base))
                for m in FILE_NAME_RE.finditer(text):  # a bare file name: some file has it
                    if m.group(1) not in basenames():
                        add(doc, line, m.group(1), f"no file of the repository is named `{m.group(1)}`")
                if base and PLACEHOLDER_RE.match(text):
                    add(
                        doc,
                        line,
                        text.strip(),
                        f"`{text.strip()}` stands alone on its line: a placeholder to fill",
                    )
                for m in DEV_PATH_RE.finditer(text):
                    add(
                        doc,
                        line,
                        m.group(0),
                        f"`{m.group(0)}` is a developer machine's path (no user has it): a path in the repository, runs/..., or words",
                    )
                for m in re.finditer(r"\]\(([^)\s#]+)", text):  # markdown links, relative to the doc
                    if not re.match(r"^\w+:", m.group(1)):
                        rel = os.path.normpath(os.path.join(os.path.dirname(doc), m.group(1)))
                        if rel.startswith("..") or not path_exists(rel):
                            add(
                                doc,
                                line,
                                m.group(1),
                                f"link `{m.group(1)}` points at nothing in the repository ({rel})",
                            )
                for m in re.finditer(r"(\S+\.py)::(\w+)", text):
                    f = m.group(1).strip("`(")
                    full = (
                        f
                        if f in repo_files()
                        else next((x for x in repo_files() if x.endswith("/" + f)), None)
                    )
                    if full and not re.search(
                        rf"^\s*(?:async\s+)?def\s+{m.group(2)}\b", py_source(full), re.M
                    ):
                        add(doc, line, m.group(0), f"`{m.group(0)}`: {full} has no test `{m.group(2)}`")
    return out
