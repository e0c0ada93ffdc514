"""The docs show only what exists: README.md, docs/**.md and bench/**/README.md, read as a user would.

Every `make` target and variable, every `python -m` module and its options (through `make` too:
OVERRIDES and the like are expanded in the target's recipe), every Hydra override (key,
config-group choice, Enum value), every repository path, file name, module or Class.attribute,
test name and upper-case variable shown in them, and the paths of conf/'s help text, are checked
against the tree as it is: the Makefile's text, the modules' `add_argument` strings (and those of
the module they hand over to), the JobConfig dataclass tree, conf/ and the files on disk. Nothing
about the layout is listed here, so the check keeps working when files move; a failure names the
doc, the line and what to change. Pure and fast: no subprocess; it imports only areal_jobs.config.

  tree.py      the repository as files: what exists, what is an output (.gitignore), modules, options
  makefile.py  targets, variables and recipes, and make's expansion of a recipe line
  overrides.py the JobConfig key tree, conf/ groups, Enum choices
  markdown.py  a doc as code snippets (fences, indented blocks, inline spans) and prose; commands
  checks.py    one function per kind of thing shown, the allow-list, and `findings`

conf/*.yaml `template: |` blocks (what `python -m launch.submit --help` prints) are read as code too.

Conventions the docs may use: `runs/...`, `<placeholder>` and `...` are not checked; a table column
headed `was` (what moved where) is history and not checked; gitignored paths are outputs.
tests/unit/test_docs_current.py runs it.
"""
