"""The commands of README.md and of the docs/ pages it points to run as written: every invocation
of train_gpt2.py, fineweb.py, hellaswag.py or bench.py (with python, or through torchrun) is parsed
by the script's real argument parser, the names a `python -c` command takes from these modules
exist, and no command holds a placeholder (`...`, `<name>`) or a glob on a variable that may be
unset (`"$X"/*`). Command lines are split into words with `shlex`.

Commands are read from fenced code blocks marked bash, sh, shell, zsh, console (only `$ ` lines) or
unmarked; from indented code blocks (only lines that start like a shell command: python, torchrun,
pip, cp, ... or NAME=value); and from inline code in the text that starts with python, torchrun or
pip. Output belongs in a ```text block."""

import argparse
import ast
import contextlib
import glob
import importlib
import io
import os
import re
import shlex

import pytest

from helpers import REPO

README = os.path.join(REPO, "README.md")
# README.md and the pages it sends readers to for what it leaves out
GUIDES = ("README.md", "docs/operations.md", "docs/performance.md", "docs/evaluation.md",
          "docs/chat.md", "docs/lab_record.md", "docs/tokenizer.md")

SCRIPTS = ("train_gpt2.py", "fineweb.py", "hellaswag.py", "bench.py")
# train_gpt2.py's commands: settings.build_parser(command=...) builds each one's parser
TRAIN_COMMANDS = ("sample", "export", "eval", "chat", "serve")
TRAIN_PLAN = "plan"  # takes the training flags
TRAIN_SFT = "sft"  # the training flags, with --sft
SHELL_INFOS = {"", "bash", "sh", "shell", "zsh", "console", "shell-session"}
SHELL_STARTERS = {"python", "python3", "torchrun", "pip", "pip3", "uv", "conda", "cp", "mv", "rm",
                  "mkdir", "cd", "ls", "cat", "export", "git", "bash", "sh", "env", "nohup", "srun",
                  "sbatch", "wget", "curl", "tar", "ln", "head", "tail", "nvidia-smi", "jupyter",
                  "source"}
INLINE_STARTERS = {"python", "python3", "torchrun", "pip", "pip3"}
MODULES = {script[:-3] for script in SCRIPTS}
WRAPPERS = {"env", "nohup", "time", "exec", "sudo"}
LAUNCHERS = {"srun", "mpirun", "mpiexec"}  # their own options, then the command they start
ALWAYS_SET = {"HOME", "PWD"}  # variables a shell always has
SEPARATORS = {"&&", "||", ";", ";;", "|", "|&", "&", "(", ")"}
REDIRECTS = {"<<<", "<<-", "<<", ">>", "&>", ">&", "<&", ">|", "<>", "<", ">"}
OPERATORS = sorted(SEPARATORS | REDIRECTS, key=len, reverse=True)  # longest first
PLACEHOLDER = re.compile(r"<[A-Za-z_][\w .-]*>")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
VARIABLE = re.compile(r"\$(?:\{(\w+)(:?[-?=+])?|(\w+))")


class ShellSyntaxError(ValueError):
    pass


def _shlex(text):
    """shlex in POSIX mode: words split at blanks and at runs of ();<>|&, quotes removed and
    escapes resolved, nothing expanded; comments are cut off before (`strip_comment`)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        raise ShellSyntaxError(f"shell syntax: {e}") from None


def strip_comment(text):
    """The command line without its comment: from the first # that starts a word outside
    quotes."""
    for i, c in enumerate(text):
        if c == "#" and (i == 0 or text[i - 1] in " \t;&|()<>"):
            with contextlib.suppress(ShellSyntaxError):
                _shlex(text[:i])  # the quotes before it are closed: a comment
                return text[:i]
    return text


def lex(text):
    """A command line as shell words and operators, and the line without its comment. Each
    word's `bare` comes from the same line lexed with every glob character and `...` escaped:
    shlex drops those escapes outside quotes only, so what stays escaped was quoted. (A quoted
    word made only of operator characters, '|', reads as an operator.)"""
    code = strip_comment(text)
    raw = _shlex(code)
    marked = _shlex(re.sub(r"[*?[]|\.\.\.", lambda m: re.sub(r"(.)", r"\\\1", m[0]), code))
    assert len(raw) == len(marked), (raw, marked)  # escapes move no word boundary
    tokens = []
    for word, mark in zip(raw, marked):
        if word and set(word) <= set("();<>|&"):  # a run of operators, e.g. ">&" or ");"
            while word:
                op = next(o for o in OPERATORS if word.startswith(o))
                tokens.append(Op(op))
                word = word[len(op):]
        else:
            tokens.append(Word(word, re.sub(r"\\[*?[.]", "", mark)))
    return tokens, code


class Word(str):
    """A shell word (quotes removed, escapes resolved); `bare`: the same less the glob
    characters and `...` that were quoted or escaped, i.e. those the shell itself would see."""

    def __new__(cls, text, bare):
        word = super().__new__(cls, text)
        word.bare = bare
        return word


class Op(str):
    """An operator: a separator or a redirection."""


def simple_commands(tokens):
    """Split at ; && || | & ( ); drop redirections and their targets (and the file descriptor
    before one, as in 2>&1). Returns ([[Word]], heredoc delimiter or None)."""
    commands, current, heredoc, it = [], [], None, iter(tokens)
    for tok in it:
        if isinstance(tok, Word):
            current.append(tok)
        elif tok in SEPARATORS:
            commands.append(current)
            current = []
        else:  # a redirection: its target is not an argument, nor a descriptor number before it
            if current and current[-1].isdigit():
                current.pop()
            target = next(it, None)
            if tok in ("<<", "<<-") and isinstance(target, Word):
                heredoc = str(target)
    commands.append(current)
    return [c for c in commands if c], heredoc


def command_lines(markdown):
    """(line number, command line) of every shell command in the README, continuation lines
    joined."""
    lines = markdown.splitlines()
    found = []  # (lineno, text, kind): kind "fenced", "console" or "indented"
    inline = []  # (lineno, text) of inline code that starts like a command
    paragraph = []  # (lineno, line) of the prose paragraph being read

    def end_paragraph():
        text = "\n".join(line for _, line in paragraph)
        for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", text, re.S):
            code = " ".join(m.group(2).split())
            # a command, not the name of a program
            if code.split(" ")[0] in INLINE_STARTERS and " " in code:
                inline.append((paragraph[0][0] + text.count("\n", 0, m.start()), code))
        paragraph.clear()

    fence, kind, prev_blank, in_indented = None, None, True, False
    for lineno, line in enumerate(lines, 1):
        if fence is not None:
            if re.match(r" {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$", line):
                fence, prev_blank = None, True
            elif kind is not None:
                found.append((lineno, line, kind))
            continue
        m = re.match(r" {0,3}(`{3,}|~{3,})\s*([^\s`]*)", line)
        if m:
            end_paragraph()
            fence = m.group(1)
            kind = ("console" if m.group(2).lower() == "console" else "fenced") \
                if m.group(2).lower() in SHELL_INFOS else None
            in_indented = False
            continue
        indented = line.startswith(("    ", "\t")) and line.strip()
        if indented and (prev_blank or in_indented):
            in_indented = True
            found.append((lineno, line.strip(), "indented"))
        elif line.strip():
            in_indented = False
            paragraph.append((lineno, line))
        else:
            end_paragraph()
        prev_blank = not line.strip()
    end_paragraph()

    commands, i = [], 0
    while i < len(found):
        lineno, text, kind = found[i]
        if kind == "console":
            if not text.lstrip().startswith("$ "):
                i += 1
                continue
            text = text.lstrip()[2:]
        start_kind = kind
        while (text.rstrip().endswith("\\") and i + 1 < len(found)
               and found[i + 1][0] == found[i][0] + 1):
            i += 1
            text = text.rstrip()[:-1] + " " + found[i][1].strip()
        i += 1
        if not text.strip():
            continue
        if start_kind == "indented":
            first = text.split()[0]
            if (first not in SHELL_STARTERS and not ASSIGNMENT.match(first)
                    and not first.startswith("./")):
                continue
        commands.append((lineno, text.strip()))
    return sorted(commands + inline)


def script_call(words):
    """(script, its arguments) when the command runs one of SCRIPTS, else None."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]  # NAME=value prefixes
    while words and words[0] in WRAPPERS:
        if words[0] == "env":
            words = [w for w in words[1:] if not ASSIGNMENT.match(w)]
        else:
            words = words[1:]
    if not words:
        return None
    prog = os.path.basename(words[0])
    if prog in LAUNCHERS:
        starts = [i for i, w in enumerate(words) if os.path.basename(w) in SCRIPTS or
                  re.fullmatch(r"torchrun|python(3(\.\d+)?)?", os.path.basename(w))]
        return script_call(words[starts[0]:]) if starts else None
    if prog in SCRIPTS:
        return prog, words[1:]
    if prog == "torchrun":
        return torchrun_call(words[1:])
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        i = 1
        while i < len(words) and words[i].startswith("-"):
            if words[i] == "-c":
                return None
            if words[i] == "-m":
                module = words[i + 1] if i + 1 < len(words) else ""
                return torchrun_call(words[i + 2:]) if module == "torch.distributed.run" else None
            i += 2 if words[i] in ("-X", "-W") else 1
        if i < len(words) and os.path.basename(words[i]) in SCRIPTS:
            return os.path.basename(words[i]), words[i + 1:]
    return None


def torchrun_call(args):
    """torchrun's own parser finds the training script (and checks torchrun's flags)."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    ns = parse(parser, args)
    if isinstance(ns, str):
        raise ValueError(f"torchrun: {ns}")
    if ns.module or ns.no_python or os.path.basename(ns.training_script) not in SCRIPTS:
        return None
    return os.path.basename(ns.training_script), list(ns.training_script_args)


def parse(parser, args):
    """parser.parse_args(args) with exact flag names (no abbreviations); the namespace, or
    argparse's error message."""
    parser.allow_abbrev = False
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit as e:
        if e.code == 0:  # --help
            return argparse.Namespace()
        lines = err.getvalue().strip().splitlines()
        if not lines:
            return f"exit status {e.code}"
        return lines[-1].split("error: ", 1)[-1]  # without "PROG: error: "


def missing_names(code):
    """What a `python -c` program takes from this repository's modules and they do not have."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return [f"python -c: invalid Python ({e.msg})"]
    aliases, problems = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES and not node.level:
            module = importlib.import_module(node.module)
            problems += [f"{node.module}.{a.name} does not exist" for a in node.names
                         if a.name != "*" and not hasattr(module, a.name)]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            if not hasattr(importlib.import_module(aliases[node.value.id]), node.attr):
                problems.append(f"{aliases[node.value.id]}.{node.attr} does not exist")
    return problems


def script_parser(script, command=None):
    if script == "train_gpt2.py":
        import settings
        return settings.build_parser(command=command)
    if script == "fineweb.py":
        import fineweb
        return fineweb.build_parser()
    if script == "hellaswag.py":
        import hellaswag
        return hellaswag.build_parser()
    import bench
    return bench.build_parser()


def check_call(script, args):
    """None if `script args` parses, else what is wrong."""
    command = None
    if script == "train_gpt2.py" and args and args[0] == TRAIN_PLAN:
        args = args[1:]
    elif script == "train_gpt2.py" and args and args[0] == TRAIN_SFT:
        args = ["--sft", *args[1:]]
    elif script == "train_gpt2.py" and args and not args[0].startswith("-"):
        if args[0] not in TRAIN_COMMANDS:
            return (f"train_gpt2.py has no subcommand {args[0]!r} (it has "
                    f"{', '.join(TRAIN_COMMANDS + (TRAIN_PLAN, TRAIN_SFT))})")
        command, args = args[0], args[1:]
    try:
        parser = script_parser(script, command)
    except Exception as e:  # e.g. a build_parser that does not take the command
        return f"cannot build its parser ({type(e).__name__}: {e})"
    ns = parse(parser, args)
    return ns if isinstance(ns, str) else None


def check_command(text, assigned):
    """Problems of one README command line; `assigned` collects the variables set so far in the
    README. Returns (problems, calls, heredoc delimiter or None)."""
    try:
        tokens, code = lex(text)
    except ShellSyntaxError as e:
        return [str(e)], [], None
    problems = []
    if PLACEHOLDER.search(code):
        problems.append(f"placeholder {PLACEHOLDER.search(code).group(0)}")
    words = [t for t in tokens if isinstance(t, Word)]
    if any("..." in w.bare for w in words):
        problems.append("'...' in a command")
    commands, heredoc = simple_commands(tokens)
    calls = []
    for cmd in commands:
        for w in cmd:
            m = VARIABLE.match(w)
            if m and w[m.end():].startswith("/") and any(g in w.bare for g in "*?["):
                name = m.group(1) or m.group(3)
                if name not in assigned and name not in ALWAYS_SET and m.group(2) is None:
                    problems.append(f"{w} globs / when ${name} is unset")
        first = cmd[0]
        if ASSIGNMENT.match(first) and len(cmd) == 1 or first in ("export", "for", "read"):
            assigned.update(m.group(0)[:-1] for w in cmd for m in [ASSIGNMENT.match(w)] if m)
            if first in ("for", "read") and len(cmd) > 1:
                assigned.add(cmd[1])
        argv = [str(w) for w in cmd]
        python = re.fullmatch(r"python(3(\.\d+)?)?", os.path.basename(argv[0]))
        if python and len(argv) > 2 and argv[1] == "-c":
            problems += missing_names(argv[2])
        try:
            call = script_call(argv)
        except ValueError as e:
            problems.append(str(e))
            continue
        if call is not None:
            calls.append(call)
            problem = check_call(*call)
            if problem:
                problems.append(f"{call[0]}: {problem}")
    return problems, calls, heredoc


def check_readme(markdown, name="README.md"):
    """Every problem found, as 'README.md:LINE: command: problem', and the script calls found."""
    problems, calls, assigned, heredoc = [], [], set(), None
    for lineno, text in command_lines(markdown):
        if heredoc is not None:
            if text.strip() == heredoc:
                heredoc = None
            continue
        found, line_calls, heredoc = check_command(text, assigned)
        with contextlib.suppress(ShellSyntaxError):
            text = lex(text)[1].strip()  # shown without its comment
        problems += [f"{name}:{lineno}: {text}: {p}" for p in found]
        calls += line_calls
    return problems, calls


# -----------------------------------------------------------------------------
# the README's figures and docs/performance.md

PERFORMANCE = os.path.join(REPO, "docs", "performance.md")
# a number as a figure is written (3,582; 1.045; 44), not a part of a word (7M), of a version
# (2.13.0) or of a longer number
NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?!\w|[.,]\d)")
UNIT = re.compile(r"\s?(?:×|%|s\b|ms\b|µs\b|GiB\b|GB\b|MB\b)")
FENCED = re.compile(r"(?ms)^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1\s*$")


def figures(text, every=True):
    """The numbers in `text`; with every=False only those that read as measured figures: with a
    decimal point or a thousands comma, or followed by a unit (×, %, s, ms, GiB, ...)."""
    return {m.group(0) for m in NUMBER.finditer(text)
            if every or "." in m.group(0) or "," in m.group(0) or UNIT.match(text, m.end())}


def shown_commands(markdown):
    """Every command a page shows, blanks squeezed: its inline code, wherever a line breaks it,
    and the lines of its code blocks without their comments."""
    prose = " ".join(FENCED.sub("", markdown).split())
    spans = {" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", prose)}
    return spans | {" ".join(strip_comment(text).split()) for _, text in command_lines(markdown)}


def performance_table(markdown):
    """(line number, value, date, [commands]) of each row of the README's Performance table: the
    inline code of its command cell that starts like a command."""
    lines = markdown.splitlines()
    start = lines.index("## Performance")
    rows = []
    for lineno, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append((lineno, [c.strip() for c in line.strip().strip("|").split("|")]))
    assert rows and rows[0][1] == ["what", "value", "date", "command"], rows[:1]
    table = []
    for lineno, (_, value, date, command) in rows[2:]:
        spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", command)]
        commands = [s for s in spans
                    if s.split(" ")[0] in INLINE_STARTERS or ASSIGNMENT.match(s.split(" ")[0])]
        table.append((lineno, value, date, commands))
    return table


def performance_problems(readme, performance):
    """What the README quotes that docs/performance.md does not hold: each row of its Performance
    table needs a command, and its commands (each whole, as the page shows it), its value's
    numbers and its date must be on the page; a README paragraph that cites the page may quote
    only figures the page has."""
    shown, held = shown_commands(performance), figures(performance)
    problems = []
    for lineno, value, date, commands in performance_table(readme):
        if not commands:
            problems.append(f"README.md:{lineno}: a performance row without its command")
        problems += [f"README.md:{lineno}: command not in docs/performance.md: {c}"
                     for c in commands if c not in shown]
        problems += [f"README.md:{lineno}: figure not in docs/performance.md: {n}"
                     for n in sorted(figures(value) - held)]
        if date not in performance:
            problems.append(f"README.md:{lineno}: date not in docs/performance.md: {date}")
    lineno = 1
    for paragraph in re.split(r"(\n\s*\n)", readme):
        if "(docs/performance.md" in paragraph and not paragraph.lstrip().startswith("|"):
            problems += [f"README.md:{lineno}: figure not in docs/performance.md: {n}"
                         for n in sorted(figures(paragraph, every=False) - held)]
        lineno += paragraph.count("\n")
    return problems


def heading_anchors(markdown):
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped,
    spaces as -, a repeated one numbered (-1, -2, ...); headings in fenced code are none."""
    anchors, seen = set(), {}
    for line in FENCED.sub("", markdown).splitlines():
        m = re.match(r"#{1,6} +(.*?)(?: +#+)?\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_links(path):
    """The relative links of a Markdown file whose file or heading does not exist."""
    with open(path, encoding="utf-8") as f:
        markdown = f.read()
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", FENCED.sub("", markdown)):
        target, _, anchor = m.group(1).partition("#")
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        full = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(full):
            broken.append(m.group(1))
        elif anchor and full.endswith(".md"):
            with open(full, encoding="utf-8") as f:
                if anchor not in heading_anchors(f.read()):
                    broken.append(m.group(1))
    return broken


# -----------------------------------------------------------------------------
# the README itself

@pytest.mark.parametrize("guide", GUIDES)
def test_readme_commands_run_as_written(guide):
    with open(os.path.join(REPO, guide), encoding="utf-8") as f:
        problems, _ = check_readme(f.read(), guide)
    assert not problems, f"{guide} commands that do not run as written:\n" + "\n".join(problems)


def test_readme_shows_commands_the_checker_sees():
    # a README whose commands sit where this test cannot read them would pass the test above
    # unchecked
    with open(README, encoding="utf-8") as f:
        lines = command_lines(f.read())
    scripts = set()
    for _, text in lines:
        try:
            commands, _ = simple_commands(lex(text)[0])
        except ShellSyntaxError:
            continue
        for cmd in commands:
            with contextlib.suppress(ValueError):
                scripts.add((script_call(list(cmd)) or ("",))[0])
    assert {"train_gpt2.py", "fineweb.py"} <= scripts


def test_every_page_of_docs_has_its_commands_checked():
    pages = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))}
    assert pages - set(GUIDES) == set()


@pytest.mark.parametrize("page", ["README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))))
def test_links_between_the_guides_resolve(page):
    assert broken_links(os.path.join(REPO, page)) == []


def test_readme_figures_are_in_performance_md():
    """Every row of the README's Performance table names its command, and docs/performance.md
    shows that command, the row's figures and its date; every figure a README paragraph quotes
    from that page is on it."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    with open(PERFORMANCE, encoding="utf-8") as f:
        performance = f.read()
    assert len(performance_table(readme)) >= 5  # the table is where this test reads it
    problems = performance_problems(readme, performance)
    assert not problems, "\n".join(problems)


# -----------------------------------------------------------------------------
# the checker, on made-up READMEs

def problems_of(markdown):
    return check_readme(markdown)[0]


def test_checker_accepts_good_commands():
    md = "\n".join([
        "Intro.", "",
        "```bash",
        "python fineweb.py --input 'my corpus'/*.jsonl --data_root data --shard_size=1000000   "
        "# a comment: ...",
        "python3 fineweb.py \\",
        "    --max_tokens 50000000 \\",
        "    --fineweb_name sample-10BT",
        "torchrun --standalone --nproc_per_node=2 fineweb.py --num_proc 2",
        "python -m torch.distributed.run --standalone --nproc_per_node 2 fineweb.py --help",
        "python bench.py --preset tiny --no-compile --only train 2>&1 | tee bench.txt",
        "python hellaswag.py -m gpt2 -d cpu --limit 10",
        "OUT=results; cp \"$OUT\"/* backup/",
        "python -c \"import fineweb; fineweb.get_encoding()\"",
        "cp \"$UNSET_DIR/*.txt\" backup/   # a quoted * is no glob",
        "cat > notes.txt <<EOF",
        "python fineweb.py --a_heredoc_line_is_no_command",
        "EOF",
        "```", "",
        "```console",
        "$ python fineweb.py --val_shard_tokens 100",
        "output with <angle> brackets and ... is not a command",
        "```", "",
        "```python",
        "prepare(..., inputs=['<file>'])",
        "```", "",
        "    python fineweb.py --num_proc 1",
        "    import fineweb; x = f(...)",
        "",
    ])
    problems, calls = check_readme(md)
    assert problems == []
    assert [script for script, _ in calls] == \
        ["fineweb.py"] * 4 + ["bench.py", "hellaswag.py", "fineweb.py", "fineweb.py"]
    assert calls[0][1] == ["--input", "my corpus/*.jsonl", "--data_root", "data",
                           "--shard_size=1000000"]
    assert calls[1][1] == ["--max_tokens", "50000000", "--fineweb_name", "sample-10BT"]


def test_lines_split_into_commands_and_words():
    tokens, code = lex("OUT=x; python bench.py --only 'a b' 2>&1 | tee \"$OUT\"/b.txt  # '#' <c>")
    assert code.rstrip() == "OUT=x; python bench.py --only 'a b' 2>&1 | tee \"$OUT\"/b.txt"
    commands, heredoc = simple_commands(tokens)
    assert commands == [["OUT=x"], ["python", "bench.py", "--only", "a b"], ["tee", "$OUT/b.txt"]]
    assert heredoc is None
    words = [w for c in simple_commands(lex("ls 'a*' \\? b[0] \"...\" ...")[0])[0] for w in c]
    assert words == ["ls", "a*", "?", "b[0]", "...", "..."]
    assert [w.bare for w in words] == ["ls", "a", "", "b[0]", "", "..."]  # what the shell globs
    assert strip_comment("echo 'a # b' x#y # z") == "echo 'a # b' x#y "


@pytest.mark.parametrize("line, problem", [
    ("python fineweb.py --no_such_flag 3", "fineweb.py: unrecognized arguments: --no_such_flag"),
    ("python fineweb.py --shard_size=many",
     "fineweb.py: argument --shard_size: expected an integer"),
    # no abbreviations
    ("python fineweb.py --max_tok 10", "fineweb.py: unrecognized arguments: --max_tok"),
    # --json is store_true
    ("python bench.py --no-json", "bench.py: unrecognized arguments: --no-json"),
    ("python hellaswag.py -d cpu",
     "hellaswag.py: the following arguments are required: -m/--model"),
    ("torchrun --standalone ... fineweb.py", "'...' in a command"),
    ("torchrun --no_such_torchrun_flag fineweb.py", "torchrun: "),
    ("pip install torch==<version>+cpu", "placeholder <version>"),
    ("python fineweb.py --input <your files>", "placeholder <your files>"),
    ('mkdir -p c && cp "$TIKTOKEN_CACHE_DIR"/* c/',
     '$TIKTOKEN_CACHE_DIR/* globs / when $TIKTOKEN_CACHE_DIR is unset'),
    ("cp $CACHE/*.bpe c/", "globs / when $CACHE is unset"),
    ("python train_gpt2.py evaluate --checkpoint x.pt",
     "train_gpt2.py has no subcommand 'evaluate'"),
    ("python train_gpt2.py sample --max_steps 3", "train_gpt2.py: unrecognized arguments"),
    ("python fineweb.py --input 'unterminated", "shell syntax: No closing quotation"),
    ("python fineweb.py --data_root 'a # b' --bogus", "unrecognized arguments: --bogus"),
    ('python -c "import fineweb as f; f.prepare; f.compare_with_naive([])"',
     "fineweb.compare_with_naive does not exist"),
    ('python -c "from hellaswag import evaluate, no_such_name"',
     "hellaswag.no_such_name does not exist"),
])
def test_checker_finds_bad_commands(line, problem):
    problems = problems_of(f"Text.\n\n```sh\n{line}\n```\n")
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"README.md:4: {line}: ") and problem in problems[0], problems


def test_checker_reads_every_kind_of_block():
    bad = "python fineweb.py --bogus"
    for md, line in [(f"```\n{bad}\n```\n", 2), (f"```bash\n{bad}\n```\n", 2),
                     (f"~~~shell\n{bad}\n~~~\n", 2), (f"```console\n$ {bad}\n```\n", 2),
                     (f"Text.\n\n    {bad}\n", 3),
                     ("```bash\npython fineweb.py \\\n  --bogus\n```\n", 2),
                     ("```bash\nsrun -N 2 torchrun --nproc_per_node 8 fineweb.py --bogus\n"
                      "```\n", 2),
                     (f"Text.\n\nRun `{bad}` in prose.\n", 3),
                     ("A paragraph\nwith `python fineweb.py\n--bogus` in it.\n", 2)]:
        problems = problems_of(md)
        assert len(problems) == 1 and problems[0].startswith(f"README.md:{line}: "), md
        assert "--bogus" in problems[0], md
    for md in [f"```python\n{bad}\n```\n", f"```text\n{bad}\n```\n",  # not shell
               f"Text\n    {bad}\n",  # not code
               "Use `python` or `torchrun`, and `fineweb.py --bogus`.\n"]:  # not commands
        assert problems_of(md) == [], md


def test_performance_check_finds_what_the_page_lacks():
    performance = "\n".join([
        "# Figures", "",
        "- **Command**: `python bench.py --only train --device cpu`",
        "- **Figure**: 3,582 tokens/s, 1.14× GPT-2's, 2026-11-30", "",
        "    python bench.py --suite gpu-estimate   # estimated", ""])
    row = "| what | value | date | command |\n| --- | --- | --- | --- |\n"
    readme = ("Intro ([measured](docs/performance.md#x)): 1.14× and 99 s in 4 steps.\n\n"
              "## Performance\n\n" + row +
              "| step | 3,582 tokens/s | 2026-11-30 "
              "| `python bench.py --only train --device cpu` |\n"
              "| gpu | 59.0 GiB | 2026-11-25 | `python bench.py --suite gpu-estimate --compile` |\n"
              "| est | 1.14× | 2026-11-30 | `python bench.py --suite gpu-estimate` |\n"
              "| none | 3,582 | 2026-11-30 | the same |\n\n## Tests\n")
    assert performance_problems(readme, performance) == [
        "README.md:8: command not in docs/performance.md: "
        "python bench.py --suite gpu-estimate --compile",
        "README.md:8: figure not in docs/performance.md: 59.0",
        "README.md:8: date not in docs/performance.md: 2026-11-25",
        "README.md:10: a performance row without its command",
        "README.md:1: figure not in docs/performance.md: 99"]


def test_heading_anchors_and_broken_links(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# `--arch modern` on the tiny preset\n\n## The README's demo (2026-11-30)\n"
                    "## Notes\n## Notes\n```\n# not a heading\n```\n"
                    "[ok](#--arch-modern-on-the-tiny-preset) [ok](#notes-1) [ok](a.md#notes)\n"
                    "[ok](https://x.org/#y) [bad](#not-a-heading) [bad](b.md) "
                    "[bad](a.md#the-readmes-demo)\n", encoding="utf-8")
    assert heading_anchors(page.read_text(encoding="utf-8")) == {
        "--arch-modern-on-the-tiny-preset", "the-readmes-demo-2026-11-30", "notes", "notes-1"}
    assert broken_links(str(page)) == ["#not-a-heading", "b.md", "a.md#the-readmes-demo"]
