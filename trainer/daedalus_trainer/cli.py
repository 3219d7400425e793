"""The `daedalus` command line.

Every subcommand imports what it needs when it runs, so `daedalus validate` and `daedalus crd` work in the operator image
(no torch) and start in well under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from daedalus_trainer import __version__

DESCRIPTION = """\
Daedalus: RL post-training (GRPO + LoRA) of vision-language agents on visual mazes, on Kubernetes or on a laptop.

  daedalus run examples/local-tiny.yaml     run a job locally on CPU (SFT -> GRPO -> evaluation), resumable
  daedalus validate job.yaml                check a job against the API, every error with its field path
  daedalus checkpoints runs/local-tiny      list a run's checkpoints: which verify, where a resume starts
  daedalus maze --size 9 --seed 3 --out m.png   render a maze and print its solution
  daedalus operator                          run the Kubernetes operator (kopf)
"""


def _cmd_crd(args: argparse.Namespace) -> int:
    from daedalus_trainer.crd import render

    text = render()
    if args.out:
        from daedalus_trainer.usage import UsageError, make_dir

        for out in args.out:  # every path first: a bad second --out leaves no first file rewritten
            if Path(out).is_dir():
                raise UsageError(f"--out {out} is a directory; give the path of the file to write")
            make_dir(Path(out).parent, "--out")
        for out in args.out:
            try:
                Path(out).write_text(text)
            except OSError as exc:  # permissions, a read-only or full file system
                raise UsageError(f"--out: cannot write {out}: {exc.strerror or exc}") from None
    else:
        sys.stdout.write(text)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from daedalus_trainer.config import (SpecError, dropped_null_notes, duplicate_name_errors, load_documents,
                                         parse_job)
    from daedalus_trainer.usage import UsageError

    if args.files.count("-") > 1:  # the second read would find standard input empty: "holds no document"
        raise UsageError("- (standard input) is given more than once; it can be read only once")
    console = Console(stderr=False, highlight=False, soft_wrap=True)
    status = 0
    for given in args.files:
        f = "<stdin>" if given == "-" else given
        try:
            docs = load_documents(given)
        except FileNotFoundError:
            console.print(f"[red]✗[/red] {escape(f)}: no such file")
            status = 1
            continue
        except SpecError as exc:
            docs, status = [], 1
            _print_errors(console, f, exc.errors)
        else:
            if not docs:  # a `kind: List` without items, e.g. `kubectl get rltj -A -o yaml` where there are no jobs
                console.print(f"- {escape(f)}: a List with no items: no RLTrainingJob to validate")
        duplicates = duplicate_name_errors(docs)
        for i, doc in enumerate(docs):
            where = f if len(docs) == 1 else f"{f} (RLTrainingJob document {i + 1} of {len(docs)})"
            errors, note, dropped = [], None, []
            try:
                job = parse_job(doc, source=f, dropped=dropped)
            except SpecError as exc:
                errors.extend(exc.errors)
                note = exc.note
            errors.extend(duplicates.get(i, []))
            if errors:
                _print_errors(console, where, errors, note)
                status = 1
                continue
            name = escape(repr(job.metadata.name))
            console.print(f"[green]✓[/green] {escape(where)}: RLTrainingJob {name} is valid")
            for note in dropped_null_notes(dropped, job):
                console.print(f"    [yellow]![/yellow] {escape(note)}")
    return status


def _print_errors(console, where: str, errors, note: str | None = None) -> None:
    """Every error with its field path, then ``note`` (what they kept from being checked); messages are printed
    literally (rich markup in them is escaped)."""
    from rich.markup import escape

    console.print(f"[red]✗[/red] {escape(where)}: {len(errors)} error(s)")
    for path, msg in errors:
        text = escape(str(msg)).replace("\n", "\n        ")  # a YAML error's lines under its first one
        console.print(f"    [bold]{escape(str(path))}[/bold]: {text}")
    if note:
        console.print(f"    ({escape(note)})")


def _cmd_maze(args: argparse.Namespace) -> int:
    from daedalus_trainer.envs.maze_cli import run

    return run(size=args.size, seed=args.seed, out=args.out, cell_px=args.cell_px, action_format=args.action_format)


def _load(path: str):
    from daedalus_trainer.config import load_job

    return load_job(path)


def _cmd_sft(args: argparse.Namespace) -> int:
    job = _load(args.config)  # a typo in the YAML is reported before seconds of imports
    from daedalus_trainer import sft
    from daedalus_trainer.policy import check_model_paths
    from daedalus_trainer.usage import make_dir, quiet_single_threaded_torch

    check_model_paths(job.spec.model)  # before --out is created
    quiet_single_threaded_torch()

    out = make_dir(Path(args.out) if args.out else Path("runs") / job.metadata.name / "sft", "--out")
    model_dir = sft.run_sft(job, out, resume=not args.no_resume)
    print(f"SFT model written to {model_dir}")
    return 0


def _check_eval_dirs(model: str, adapter: str | None) -> None:
    """Refuse the ``daedalus eval`` directories that are the wrong kind where the right one is at hand: a PEFT adapter
    given as ``--model``, or a directory whose ``model/`` (``--model``) or ``adapter/`` (``--adapter``) subdirectory
    is what was meant (``runs/<name>/sft``, a GRPO checkpoint ``step-NNNNNN`` or ``runs/<name>/exports``). Anything
    else is left to the loaders' own messages.

    Raises:
        daedalus_trainer.usage.UsageError: naming the directory and what to give instead.
    """
    from daedalus_trainer.policy import is_adapter_dir, is_checkpoint_dir
    from daedalus_trainer.usage import UsageError

    if Path(model).is_dir() and not is_checkpoint_dir(model):
        if is_adapter_dir(model):
            raise UsageError(f"--model {model} is a PEFT adapter (adapter_config.json), not a model: give it as "
                             f"--adapter {model}, with its base model as --model (for a local run: "
                             "runs/<name>/sft/model)")
        if is_checkpoint_dir(Path(model) / "model"):
            raise UsageError(f"--model {model} holds no config.json; its model is --model {Path(model) / 'model'}")
    inner = Path(adapter) / "adapter" if adapter else None
    if adapter and Path(adapter).is_dir() and not is_adapter_dir(adapter) and is_adapter_dir(inner):
        raise UsageError(f"--adapter {adapter} holds no adapter_config.json; its adapter is --adapter {inner}")


def _cmd_eval(args: argparse.Namespace) -> int:
    job = _load(args.config)  # a typo in the YAML is reported before seconds of imports
    from daedalus_trainer import evaluation
    from daedalus_trainer.usage import UsageError, make_dir, new_dirs, quiet_single_threaded_torch, remove_empty_dirs

    quiet_single_threaded_torch()

    eval_set = job.spec.environment.eval_mazes
    if args.mazes is not None and args.mazes > eval_set:  # the sets hold evalMazes mazes: silently fewer, before
        raise UsageError(f"--mazes {args.mazes} is more than the {eval_set} mazes of the job's evaluation sets "
                         f"(environment.evalMazes); give --mazes {eval_set} or fewer, or raise environment.evalMazes "
                         "(which also holds more layouts out of training)")
    _check_eval_dirs(args.model, args.adapter)
    created: list[tuple[Path, Path | None]] = []  # (directory, the outermost one make_dir created for it)

    def make_output_dir(path: str | Path, what: str) -> None:  # now, so that a bad path fails in a second
        top = new_dirs(path)
        created.append((make_dir(path, what), top))

    if args.json:  # before minutes of evaluation, not after
        if Path(args.json).is_dir():
            raise UsageError(f"--json {args.json} is a directory; give the path of the JSON file to write")
        make_output_dir(Path(args.json).parent, "--json")
    if args.gif:  # likewise: the GIFs are written after the evaluation
        if "image" not in job.spec.environment.observation:  # they are drawn from the episodes' images
            raise UsageError(f"--gif: the job's environment.observation is {job.spec.environment.observation!r}: "
                             "its episodes have no images to draw GIFs from (use 'image' or 'image+ascii')")
        if Path(args.gif).exists() and not Path(args.gif).is_dir():
            raise UsageError(f"--gif {args.gif} is a file; give the directory to write the GIFs into")
        make_output_dir(args.gif, "--gif")
    from rich.console import Console

    console = Console()
    try:
        with evaluation.EvalProgress(console) as progress:
            report = evaluation.run_eval(
                job, args.model, adapter_path=args.adapter, greedy=True, sampled=not args.greedy_only,
                gif_dir=args.gif, n=args.mazes, split=args.split, progress=progress,
            )
    except BaseException:  # the model did not load, Ctrl-C, ...: the directories made for the outputs go again
        for path, top in created:
            remove_empty_dirs(path, top)
        raise
    console.print(report.table())
    if args.json:
        from daedalus_trainer.checkpoint import atomic_write_text

        atomic_write_text(args.json, report.to_json())  # a result: never left half-written by a kill
    return 0


def _size(n: int) -> str:
    """``n`` bytes for a table cell: B, kB, MB, GB (powers of 1000, as ``du --si``)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _checkpoint_root(given: str, runs_dir: str = "runs") -> Path:
    """The checkpoint root ``daedalus checkpoints`` reads: ``given``; its ``checkpoints/`` when ``given`` is a run or
    job directory (``runs/<name>``, ``<checkpoint.path>/<namespace>/<name>``) holding one; its parent when ``given``
    is one checkpoint (holds MANIFEST.json: the job's ``status.latestCheckpoint.path``)."""
    from daedalus_trainer.usage import UsageError

    path = Path(given)
    if not path.exists():
        raise UsageError(f"{given}: no such directory (give a checkpoint root, e.g. runs/<name>/checkpoints, or "
                         "the run directory holding it)")
    if path.is_file():  # a job file, as `daedalus run` takes it: that run's checkpoints
        from daedalus_trainer.config import load_job

        return Path(runs_dir) / load_job(given).metadata.name / "checkpoints"
    if not path.is_dir():
        raise UsageError(f"{given} is not a directory or a job file; give a checkpoint root "
                         "(runs/<name>/checkpoints), the run directory holding it, or the job's YAML")
    from daedalus_trainer.checkpoint import is_checkpoint_name

    # one checkpoint (status.latestCheckpoint.path), however damaged: the root holding it
    if (path / "MANIFEST.json").is_file() or is_checkpoint_name(path.name):
        return path.parent
    if (path / "checkpoints").is_dir() and not any(is_checkpoint_name(e.name) for e in path.iterdir()):
        return path / "checkpoints"
    return path


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    import datetime as dt
    import json

    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from daedalus_trainer.checkpoint import delete_abandoned, inspect_root

    root = _checkpoint_root(args.root, args.runs_dir)
    if Path(args.root).is_file() and not root.exists():  # a job that has not run here yet
        print(f"{root}: no checkpoints yet\nresume: latest starts fresh (no step-* checkpoint)")
        return 0
    entries = inspect_root(root, verify=not args.no_verify)
    deleted, failed = delete_abandoned(root) if args.delete_abandoned else ([], [])
    gone = {e.name for e in deleted}
    kept = [e for e in entries if e.name not in gone]
    checkpoints = [e for e in kept if e.kind in ("checkpoint", "replaced")]
    chosen = next((e for e in checkpoints if e.chosen), None)
    unreadable = any(e.error for e in checkpoints)
    refuses = bool(checkpoints) and not args.no_verify and chosen is None
    status = 1 if refuses or unreadable or failed else 0
    if args.json:
        doc = {
            "root": str(root.absolute()),
            "resumeFrom": None if chosen is None else chosen.name,
            "entries": [
                {"name": e.name, "kind": e.kind, "step": e.step, "bytes": e.bytes, "time": e.time,
                 "latest": e.latest, "chosen": e.chosen, "error": e.error,
                 "problems": None if e.problems is None else [str(p) for p in e.problems]}
                for e in kept
            ],
            "deleted": [{"name": e.name, "bytes": e.bytes} for e in deleted],
            "notDeleted": [{"name": e.name, "error": why} for e, why in failed],
            "ok": status == 0,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return status

    console = Console(highlight=False)

    def say(line: str) -> None:  # a line as it is (the terminal wraps it), not cut at rich's idea of the width
        console.print(line, soft_wrap=True)

    if kept:
        table = Table(title=f"checkpoints under {escape(str(root))}", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("name", overflow="fold")
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("saved (UTC)", no_wrap=True)
        table.add_column("state", overflow="fold", min_width=24)
        for e in kept:
            if e.kind == "leftover":
                state = "[dim]leftover (the next save removes it)[/]"
            elif e.kind == "replaced" and not e.error and e.problems is None:
                state = f"a re-save's old copy of step-{e.step:06d} (the next resume puts it back)"
            elif e.error:
                state = f"[red]unreadable[/]: {escape(e.error)}"
            elif e.problems is None:
                state = "not verified"
            elif e.problems:
                state = "[red]corrupt[/]: " + escape("; ".join(f"{p.file}: {p.reason}" for p in e.problems))
            else:
                state = "ok"
            if e.kind == "replaced" and e.problems is not None:
                state += f" [dim](a re-save's old copy of step-{e.step:06d}: the next resume puts it back)[/]"
            marks = [m for m, on in (("latest", e.latest), ("resume", e.chosen)) if on]
            if marks:
                state += f" [bold]<- {', '.join(marks)}[/]"
            saved = "-" if e.time is None else dt.datetime.fromtimestamp(e.time, dt.timezone.utc).strftime(
                "%Y-%m-%d %H:%M")
            table.add_row(escape(e.name), _size(e.bytes), saved, state)
        console.print(table)
        say("[dim]latest: the pointer names it; resume: `--resume latest` starts from it (the newest that "
                      "verifies); abandoned-step-*: a timeline a run did not continue (`--resume none` or an older "
                      "PATH), never resumed from by `latest`[/]")
    by_kind = {k: [e for e in kept if e.kind == k or (k, e.kind) == ("checkpoint", "replaced")]
               for k in ("checkpoint", "abandoned", "leftover")}
    nouns = {"checkpoint": "checkpoint", "abandoned": "abandoned timeline", "leftover": "leftover"}
    parts = [f"{len(v)} {nouns[k]}{'s' if len(v) != 1 else ''} ({_size(sum(e.bytes for e in v))})"
             for k, v in by_kind.items() if v or k == "checkpoint"]
    say(f"{escape(str(root))}: " + ", ".join(parts))
    if args.no_verify:
        say("resume: not verified (--no-verify); a resume verifies the newest first")
    elif chosen is not None:
        say(f"resume: latest starts from {chosen.name} (step {chosen.step})")
    elif unreadable:
        say("resume: latest would fail until the file system answers (an I/O error, not corruption)")
    elif checkpoints:
        say("[red]resume: latest refuses to start: no checkpoint verifies[/] (`--resume none` starts over "
            "and keeps them as abandoned-*; `--resume PATH` continues from a copy)")
    else:
        say("resume: latest starts fresh (no step-* checkpoint)")
    if deleted:
        say(f"deleted {len(deleted)} abandoned director{'y' if len(deleted) == 1 else 'ies'}, "
            f"{_size(sum(e.bytes for e in deleted))} freed")
    elif by_kind["abandoned"] and not args.delete_abandoned:
        say("abandoned timelines are never deleted by a run; --delete-abandoned deletes them")
    for e, why in failed:
        say(f"[red]could not delete {escape(e.name)}[/]: {escape(why)} (what is left is a .trash-* directory the next "
            "save removes)")
    return status


def _cmd_train(args: argparse.Namespace) -> int:
    from daedalus_trainer import grpo

    return grpo.main_train(config=args.config, resume=args.resume, out_dir=args.out)


def _cmd_run(args: argparse.Namespace) -> int:
    from daedalus_trainer import local

    return local.run_local(args.job, runs_dir=args.runs_dir, resume=args.resume, port=args.port)


def _cmd_operator(args: argparse.Namespace) -> int:
    try:
        from daedalus_operator.main import main as operator_main
    except ImportError as exc:  # the operator extra is not installed
        print(f"daedalus operator needs the 'operator' extra (pip install 'daedalus[operator]'): {exc}", file=sys.stderr)
        return 2
    return operator_main(args.operator_args)


def _resume_option(text: str) -> str:
    """argparse type of ``--resume``: ``latest``, ``none`` or a path that exists (what it holds is verified when the
    checkpoint is loaded, before any training starts).

    Raises:
        argparse.ArgumentTypeError: anything else (a typo such as ``lastest`` fails here, not after SFT).
    """
    if text in ("latest", "none") or Path(text).exists():
        return text
    raise argparse.ArgumentTypeError(f"expected 'latest', 'none' or the path of a checkpoint; {text!r} does not exist")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _int_between(lo: int, hi: int, what: str):
    """argparse type: an integer in [lo, hi] (``what`` says where the bounds come from).

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside the bounds.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be {lo}-{hi} ({what}), got {value}")
        return value

    return parse


def _port_option(text: str) -> int:
    """argparse type of ``--port``: a TCP port number, 0-65535 (its default comes from ``$DAEDALUS_METRICS_PORT``
    and is checked only by the subcommand that uses it: a bad variable does not break ``daedalus validate``).

    Raises:
        argparse.ArgumentTypeError: not a whole number, or outside 0-65535.
    """
    from daedalus_trainer.usage import UsageError, port_number

    try:
        return port_number(text, "port")
    except UsageError:
        source = " (from $DAEDALUS_METRICS_PORT)" if text == os.environ.get("DAEDALUS_METRICS_PORT") else ""
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}{source}") from None


#: ``daedalus --help``'s epilog: what the exit codes mean (the operator's own are in ``daedalus operator --help``'s).
EXIT_STATUS = """exit status:
  0    done (a training run also when stopped on request: the operator resumes it)
  1    `validate`: a job file is invalid or missing (each error listed); any command: an unexpected
       failure, printed with its traceback
  2    bad arguments (any command); run/train/sft/eval/maze: bad input (spec, file, checkpoint,
       port): one line says which, before any work
  130  interrupted (Ctrl-C): run the same command again to resume (`run` during GRPO: the step in
       progress was checkpointed first, unless Ctrl-C was pressed twice)
  143  `run` stopped by SIGTERM during GRPO, the step in progress checkpointed: run it again to resume
`daedalus operator --help` lists the operator's own."""


def _stdin_help(command: str) -> str:
    """The help of the job argument of ``run``, ``train``, ``sft`` and ``eval`` on standard input (``load_job('-')``),
    with ``command`` (e.g. ``"daedalus run -"``) as the example."""
    return f"- reads the job from standard input (kubectl get rltj NAME -o yaml | {command})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (also used by tests and `--help`)."""
    p = argparse.ArgumentParser(prog="daedalus", description=DESCRIPTION, epilog=EXIT_STATUS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"daedalus {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("run", help="run an RLTrainingJob YAML locally on CPU (SFT if needed, GRPO, evaluation)",
                       description="Run the same YAML you would `kubectl apply`, locally: starts a local Ray, ignores "
                       "`spec.cluster`, trains an SFT starting point if `model.sftAdapter` is absent (tiny model), runs "
                       "GRPO with checkpoints under RUNS_DIR/<name>/, evaluates before and after on held-out mazes and "
                       "writes report.json and curves.png. Interrupt it and run it again: it resumes.")
    s.add_argument("job", help=f"RLTrainingJob YAML or JSON file; {_stdin_help('daedalus run -')}")
    s.add_argument("--runs-dir", default="runs", help="parent of the run directory RUNS_DIR/<name>/ (default: ./runs)")
    s.add_argument("--resume", default="latest", type=_resume_option,
                   help="latest (default) | none | PATH of a checkpoint (directory step-NNNNNN or a checkpoints/ root)")
    s.add_argument("--port", type=_port_option, default=os.environ.get("DAEDALUS_METRICS_PORT"),
                   help="metrics/control HTTP port on 127.0.0.1 (0: pick a free one; default $DAEDALUS_METRICS_PORT, "
                        "else 9400). A port given here or in the variable must be free: checked before any work. "
                        "Taken by another program by the time GRPO starts, either gives way to a free port, with a "
                        "warning")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser("train", help="GRPO training (what the Ray job runs on a cluster)",
                       description="GRPO training of the job in --config: what the operator's Ray job runs on the "
                       "RayCluster (the config is the job spec the operator writes to a ConfigMap). It attaches to the "
                       "running Ray, or starts a local one. SIGTERM (ray job stop, a container stop) ends the step in "
                       "progress, writes its checkpoint and exits 0, as POST /stop does; a second SIGTERM exits at "
                       "once. On a laptop use `daedalus run JOB.yaml` instead: it adds SFT, evaluation and the report "
                       "around this.")
    s.add_argument("--config", required=True,
                   help="job spec as YAML or JSON (the operator's ConfigMap); "
                        f"{_stdin_help('daedalus train --config -')}")
    s.add_argument("--resume", default="latest", type=_resume_option,
                   help="latest (default) | none | PATH of a checkpoint (directory step-NNNNNN or a checkpoints/ root)")
    s.add_argument("--out", default=None,
                   help="job directory: checkpoints go to OUT/checkpoints, the final adapter to OUT/exports/adapter "
                        "(default <checkpoint.path>/<namespace>/<name>)")
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("sft", help="supervised fine-tuning: the GRPO starting point",
                       description="Supervised fine-tuning with the job's `sft` section: solver demonstrations on the "
                       "training layouts and, with `sft.onPolicyFraction` > 0, the policy's own states labelled with "
                       "the solver's move (DAgger). Stops at `sft.steps` or `sft.maxSeconds`, whichever comes first; "
                       "resumes from its own checkpoint. Writes OUT/model (default runs/<name>/sft/model).")
    s.add_argument("config", help=f"RLTrainingJob YAML or JSON file; {_stdin_help('daedalus sft -')}")
    s.add_argument("--out", default=None, help="output directory (default runs/<name>/sft)")
    s.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    s.set_defaults(func=_cmd_sft)

    s = sub.add_parser("eval", help="evaluate a model (and adapter) on the held-out mazes",
                       description="Greedy (and sampled) success on the job's held-out layouts, with 95% intervals. "
                       "Example: daedalus eval examples/local-tiny.yaml --model runs/local-tiny/sft/model "
                       "--adapter runs/local-tiny/exports/adapter")
    s.add_argument("config", help=f"RLTrainingJob YAML or JSON file (environment and eval set); "
                   f"{_stdin_help('daedalus eval - --model DIR')}")
    s.add_argument("--model", required=True, help="model directory (a full checkpoint, e.g. runs/<name>/sft/model)")
    s.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory")
    s.add_argument("--mazes", type=_positive_int, default=None,
                   help="evaluate on the first N mazes of the set, N <= environment.evalMazes (held-out: N layouts, "
                        "each played from environment.evalCorners start/goal corner pairs; default: all "
                        "environment.evalMazes)")
    s.add_argument("--split", choices=("held-out", "training"), default="held-out",
                   help="held-out: the evaluation layouts, excluded from training (default); training: as many mazes "
                        "on layouts training draws from (what training learned where it trained)")
    s.add_argument("--greedy-only", action="store_true", help="skip sampled evaluation")
    s.add_argument("--json", default=None, help="write the report as JSON to this file (parent directories created)")
    s.add_argument("--gif", default=None, help="write animated GIFs of some greedy episodes to this directory (half "
                                                "successes, half failures; needs image observations)")
    s.set_defaults(func=_cmd_eval)

    s = sub.add_parser("validate", help="validate RLTrainingJob files (every error with its field path)",
                       description="Check RLTrainingJob files against the API as the API server would (apiVersion, "
                       "kind and metadata.name required, namespace and labels in Kubernetes syntax, types strict, "
                       "unknown fields and duplicate keys rejected, the CRD's cross-field rules), without a cluster. "
                       "A file may hold several documents or a `kind: List` (`kubectl get rltj -A -o yaml`); two jobs "
                       "with the same namespace and name in one file are an error. Exit status 1 when any document "
                       "is invalid.")
    s.add_argument("files", nargs="+", help="YAML or JSON files (each may hold several documents); - reads standard "
                   "input (kubectl get rltj -A -o yaml | daedalus validate -)")
    s.set_defaults(func=_cmd_validate)

    s = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, whether each verifies, where a "
                       "resume starts; delete abandoned ones",
                       description="List the checkpoints under a checkpoint root (runs/<name>/checkpoints locally; "
                       "<checkpoint.path>/<namespace>/<name>/checkpoints on a cluster volume): step, size, save time, "
                       "whether each verifies against its manifest (sha256 of every file, what a resume does) and "
                       "which one `--resume latest` starts from. Lists abandoned-step-* directories too (timelines a "
                       "run with `--resume none` or an older PATH did not continue; runs never delete them) and "
                       "leftovers of an interrupted save. Reads only, unless --delete-abandoned; safe beside a "
                       "running trainer. Exit status 1 when checkpoints exist and none verifies (a resume would "
                       "refuse), one could not be read, or a deletion failed.")
    s.add_argument("root", help="checkpoint root, the run directory holding checkpoints/ (e.g. runs/local-tiny), "
                   "one checkpoint in it (a job's status.latestCheckpoint.path), or a job YAML as `daedalus run` takes "
                   "it (its RUNS_DIR/<name>/checkpoints)")
    s.add_argument("--runs-dir", default="runs", help="with a job YAML: the --runs-dir its `daedalus run` used "
                   "(default: ./runs)")
    s.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 verification (reads every byte of every checkpoint)")
    s.add_argument("--delete-abandoned", action="store_true",
                   help="delete the abandoned-step-* directories (never a step-* checkpoint or the latest pointer)")
    s.add_argument("--json", action="store_true", help="print the listing as JSON instead of a table")
    s.set_defaults(func=_cmd_checkpoints)

    s = sub.add_parser("crd", help="print the RLTrainingJob CustomResourceDefinition generated from the API models",
                       description="The RLTrainingJob CRD (OpenAPI schema, defaults, CEL rules, printer columns) "
                       "generated from the pydantic API; crds/ and the chart's copy are this output (`make crds`).")
    s.add_argument("--out", action="append", help="write to this file instead of stdout (repeatable)")
    s.set_defaults(func=_cmd_crd)

    s = sub.add_parser("maze", help="render a maze to PNG and print the ASCII map and the solver's solution",
                       description="Generate the maze a seed gives (the one Maze2DEnv(size).reset(seed=SEED) starts "
                       "with), print its map and shortest solution, and write its picture with --out.")
    s.add_argument("--size", type=_int_between(5, 63, "environment.size's range"), default=9,
                   help="odd side length including walls, 5-63 (default 9)")
    s.add_argument("--seed", type=int, default=0, help="maze seed (default 0; the same seed gives the same maze)")
    s.add_argument("--out", default=None, help="write the picture here: PNG, or the format the name's extension says (.jpg, .gif, ...); "
                                            "default: no picture, text only")
    s.add_argument("--cell-px", type=_int_between(4, 128, "environment.cellPixels' range"), default=25,
                   help="cell size in pixels, 4-128 (default 25, as VisGym)")
    s.add_argument("--action-format", default="function", choices=["function", "tuple", "tag"],
                   help="syntax of the printed solution: move(\"up\"), ('move', 1) or <action>up</action> "
                        "(default function)")
    s.set_defaults(func=_cmd_maze)

    s = sub.add_parser("operator", help="run the Kubernetes operator (kopf); arguments after it go to the operator",
                       add_help=False)
    s.add_argument("operator_args", nargs=argparse.REMAINDER)
    s.set_defaults(func=_cmd_operator)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `daedalus` console script. Returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "operator":  # everything after it belongs to the operator's own parser (-A, --help, ...)
        return _cmd_operator(argparse.Namespace(operator_args=argv[1:]))
    parser = build_parser()
    if not argv:  # the whole help, its examples included, rather than argparse's one-line "required" error
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a clean message for known user errors, a traceback for bugs
        from daedalus_trainer.config import SpecError

        from daedalus_trainer.usage import UsageError

        user_errors: tuple[type[Exception], ...] = (SpecError, UsageError, FileNotFoundError)
        try:  # layouts needs the environment's packages, which the operator image lacks
            from daedalus_trainer.layouts import LayoutError

            user_errors += (LayoutError,)
        except ImportError:
            pass
        try:  # torch-free images (the operator's) have no checkpoint module
            from daedalus_trainer.checkpoint import CheckpointError

            user_errors += (CheckpointError,)
        except ImportError:
            pass
        if isinstance(exc, user_errors):
            if isinstance(exc, FileNotFoundError) and exc.filename:  # not "[Errno 2] No such file or directory: ..."
                print(f"error: {exc.filename}: no such file or directory", file=sys.stderr)
            else:
                print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # `python -m daedalus_trainer.cli` works like `python -m daedalus_trainer`
    sys.exit(main())
