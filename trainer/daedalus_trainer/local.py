"""`daedalus run JOB.yaml`: the embedded default. The YAML a user would `kubectl apply`, run on this machine.

Stages, each resumable (run the command again after an interrupt and it continues where it stopped):

1. SFT starting point: `model.sftAdapter` if set, else (tiny model) supervised fine-tuning on solver demonstrations
   into ``runs/<name>/sft/``.
2. Evaluation of the starting point on the held-out mazes (greedy and sampled), cached in ``eval-before.json``, and
   greedy on as many mazes on training layouts (``eval-before-training.json``). The cache is used only while it
   describes the same start (:func:`start_fingerprint`): a retrained or continued SFT model, another evaluation
   set or sampling setting, or ``--resume none`` evaluates again, and so does a cache file that does not parse (a
   warning names it). Every file a later run reads back (the caches, ``report.json``) is written atomically.
3. GRPO with a LoRA adapter on a local Ray (`spec.cluster` is ignored), checkpoints in ``runs/<name>/checkpoints/``,
   metrics and control on http://127.0.0.1:<port>/metrics. A first Ctrl-C ends the step in progress and writes its
   checkpoint before stopping (exit 130; :func:`~daedalus_trainer.grpo.stop_on_sigint`), a second interrupts at once;
   SIGTERM likewise (exit 143; :func:`~daedalus_trainer.grpo.stop_on_sigterm`).
4. Evaluation of the trained adapter (the same two sets; cached in ``eval-after.json`` and
   ``eval-after-training.json`` while the adapter's content is the same, so a rerun of a finished run evaluates
   nothing again and keeps the report's timings), then a before/after table, ``report.json`` and ``curves.png``.
   The held-out columns are the result; the training-layout column shows what training learned on the layouts it
   trained on, so a gain there without one on held-out layouts reads as memorisation.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daedalus_trainer.usage import make_dir, quiet_single_threaded_torch

if TYPE_CHECKING:
    from daedalus_trainer.checkpoint import LoadedCheckpoint

log = logging.getLogger("daedalus.local")


def _free_port(preferred: int) -> int:
    """``preferred`` if it can be bound on 127.0.0.1 (:func:`~daedalus_trainer.usage.check_port_free`, which binds as
    the server does), else a free port (0 asks for a free one)."""
    from daedalus_trainer.usage import UsageError, check_port_free

    if preferred:
        try:
            check_port_free("127.0.0.1", preferred, "--port")
            return preferred
        except UsageError:
            log.warning("port %d is taken; serving metrics on a free port instead", preferred)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fingerprint(job, model_path: str, adapter_path: str | None) -> str:
    """What a cached evaluation (of the starting point, or of the trained adapter) depends on, as a sha256 hex
    digest: the file name, size in bytes and modification time (ns) of every weight file (``*.safetensors``,
    ``*.bin``) in ``model_path``, the name and sha256 of every weight file in ``adapter_path``, and the job's
    ``environment`` and sampling settings (``temperature``, ``topP``, ``maxTokensPerTurn``). The model by file
    metadata, so a multi-GB base model costs no read (any new save of it changes the modification time); the adapter
    (megabytes) by content, because every finished run exports it again, byte for byte the same."""
    import hashlib

    from daedalus_trainer.checkpoint import weight_files

    # names, not paths: the same run continued from another working directory is the same start
    files = [[role, *entry] for role, d in (("model", model_path), ("adapter", adapter_path)) if d
             for entry in weight_files(d, by_content=role == "adapter")]
    algo = job.spec.algorithm
    key = {"files": files, "environment": job.spec.environment.model_dump(mode="json"),
           "sampling": [algo.temperature, algo.top_p, algo.max_tokens_per_turn]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _read_json_object(path: Path, what: str) -> dict | None:
    """The JSON object in ``path``, else ``None`` with a warning naming the file: it does not parse (truncated by a
    kill or a full disk while an older version wrote it in place, or not UTF-8) or is not a JSON object. ``what``
    says in the warning what is done instead. A file that cannot be read at all (``OSError``) is raised."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        log.warning("%s does not parse as JSON (%s), probably cut short by an interrupted write: %s", path, e, what)
        return None
    if not isinstance(doc, dict):
        log.warning("%s holds a JSON %s, not an object: %s", path, type(doc).__name__, what)
        return None
    return doc


def _cached_evaluation(console, job, model_path: str, adapter_path: str | None, run_dir: Path, when: str, *,
                       title: str, stale: str | None = None, use_cache: bool = True) -> tuple[dict, dict]:
    """``(held-out, training-layout)`` evaluation reports of ``model_path`` (+ ``adapter_path``), from
    ``run_dir/eval-<when>.json`` and ``eval-<when>-training.json`` while both carry this start's
    :func:`start_fingerprint`, else evaluated now (under the rule ``title``; ``stale`` printed first when the files
    exist but describe another start) and written there with it, atomically
    (:func:`~daedalus_trainer.checkpoint.atomic_write_json`). A cached file that does not parse as a JSON object is
    logged as a warning with its path and the evaluation runs again: the files are only a cache.

    Both reports' ``model_path`` and ``adapter_path`` are absolute (made so from the working directory, ``..``
    resolved as text), cached ones included (a cache written from another working directory, or with the paths as
    given, names the same files by its fingerprint): ``report.json`` is read later from elsewhere, and its
    ``adapter`` is absolute too.

    Raises:
        OSError: a cached file exists but cannot be read, or the new ones cannot be written.
    """
    from daedalus_trainer.checkpoint import atomic_write_json

    model_path = os.path.abspath(model_path)
    adapter_path = os.path.abspath(adapter_path) if adapter_path else None
    files = run_dir / f"eval-{when}.json", run_dir / f"eval-{when}-training.json"
    fingerprint = start_fingerprint(job, model_path, adapter_path)
    if use_cache and all(f.is_file() for f in files):
        cached = [_read_json_object(f, "evaluating again") for f in files]
        if all(ev is not None and ev.get("start_fingerprint") == fingerprint for ev in cached):
            for ev in cached:
                ev["model_path"], ev["adapter_path"] = model_path, adapter_path
            return cached[0], cached[1]
        if stale and all(ev is not None for ev in cached):
            console.print(stale)
    console.rule(title)
    evaluated = _evaluate(job, model_path, adapter_path, console)
    for ev, path in zip(evaluated, files):
        ev["start_fingerprint"] = fingerprint
        atomic_write_json(path, ev)
    return evaluated


def _kept_timings(report_file: Path, steps: int) -> tuple[float, float, int | None] | None:
    """``(wall_seconds, grpo_wall_seconds, grpo_resumed_from)`` of the earlier ``report.json`` at ``report_file`` when
    it records the same ``steps`` (a rerun of a finished run keeps the timings of the call that trained; the last is
    None when that call started from step 0 or the report predates the key), else ``None``: no such file, another
    step count, or a file that does not parse or lacks them (logged as a warning with its path; the new timings are
    reported then).

    Raises:
        OSError: the file exists but cannot be read.
    """
    if not report_file.is_file():
        return None
    old = _read_json_object(report_file, "reporting this call's timings")
    if old is None or old.get("steps") != steps:
        return None
    timings = old.get("wall_seconds"), old.get("grpo_wall_seconds")
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in timings):
        log.warning("%s lacks wall_seconds/grpo_wall_seconds: reporting this call's timings", report_file)
        return None
    resumed = old.get("grpo_resumed_from")
    return float(timings[0]), float(timings[1]), resumed if isinstance(resumed, int) and resumed >= 0 else None


def _evaluate(job, model_path: str, adapter_path: str | None, console=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(held-out, training-layout)`` evaluation reports as dicts: the policy is loaded once; greedy and sampled on
    the held-out mazes, greedy on as many mazes on training layouts; each pass's progress on ``console``."""
    from daedalus_trainer import evaluation

    engine = evaluation.load_engine(job, model_path, adapter_path)
    with evaluation.EvalProgress(console) as progress:
        held_out, training = (
            evaluation.evaluate_split(engine, job, split, greedy=True, sampled=split == "held-out",
                                      model_path=model_path, adapter_path=adapter_path, progress=progress)
            for split in ("held-out", "training")
        )
    return json.loads(held_out.to_json()), json.loads(training.to_json())


#: ``daedalus run``'s metrics/control port when none is given (a free one instead when it is taken).
DEFAULT_PORT = 9400


def _check_continuable(job: Any, loaded: LoadedCheckpoint, run_dir: Path) -> None:
    """Refuse, before SFT and the evaluation, to continue the GRPO checkpoint ``loaded`` when the run could only refuse
    it later (:func:`daedalus_trainer.grpo.check_same_run`): other GRPO settings, or a starting point that differs or
    that SFT would now train further (``sft.steps`` raised with GRPO checkpoints on the shorter SFT).

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: what differs, and the ways on.
    """
    from daedalus_trainer import sft
    from daedalus_trainer.checkpoint import CheckpointError
    from daedalus_trainer.grpo import check_same_run, run_identity

    saved = loaded.trainer_state.extra.get("identity")
    start_dir: str | None = job.spec.model.sft_adapter
    if not start_dir:
        result, why, cause = sft.reusable_result(job, run_dir / "sft")
        if result is None:
            checkpoints = run_dir / "checkpoints"
            aside = f"mv {checkpoints} {checkpoints}.old"
            if cause is sft.Retrain.BUDGET_RAISED:  # sft.steps (or maxSeconds) raised since GRPO started
                ways = (f"To train GRPO again from the longer SFT, move the GRPO checkpoints aside ({aside}) and run "
                        "again; to continue GRPO, restore the sft settings; to start everything over, --resume none")
            else:  # no SFT run here, an unfinished one, another job's, or a damaged one
                ways = (f"To train GRPO from a new SFT start, move the GRPO checkpoints aside ({aside}) and run again, "
                        "or start everything over with --resume none")
            raise CheckpointError(f"{loaded.path} continues GRPO from the SFT model it started from, but {why}; "
                                  f"GRPO cannot continue on another starting point. {ways}")
        start_dir = str(result)
    check_same_run(saved, run_identity(job, start_dir), loaded.path)


def run_local(job_path: str, runs_dir: str = "runs", resume: str = "latest", port: int | None = None) -> int:
    """Run SFT (if needed) -> eval -> GRPO -> eval for the job in ``job_path`` and print the report.

    ``port``: the metrics/control port on 127.0.0.1. One given (``--port``, ``$DAEDALUS_METRICS_PORT``) must be free
    now, before any work (0 picks a free one); None serves on :data:`DEFAULT_PORT`. Either, when another program has
    taken it by the time GRPO starts, gives way to a free port (a warning says so). Returns the process exit code (0
    on success; 130 / 143 after a Ctrl-C / SIGTERM during GRPO).

    Raises:
        daedalus_trainer.config.SpecError: the YAML is invalid (every error with its field path).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from daedalus_trainer.config import load_job

    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job = load_job(job_path)  # a typo in the YAML is reported before seconds of imports
    quiet_single_threaded_torch(warnings=False)  # per-save "Writing model shards" bars would drown the real ones
    console, errors = Console(), Console(stderr=True, soft_wrap=True, highlight=False)
    run_dir = Path(runs_dir) / job.metadata.name

    def refuse(message: str) -> int:
        """One ``error:`` line, as the other commands print theirs (paths are shown literally, brackets too)."""
        errors.print(f"[red]error: {escape(message)}[/red]")
        return 2

    if not job.spec.model.sft_adapter and not job.spec.model.tiny:
        return refuse("model.sftAdapter is required for a non-tiny model: daedalus run trains an SFT starting point "
                      "itself only for model.tiny; give the PEFT adapter or model directory of a supervised start")
    from daedalus_trainer.policy import ModelLoadError, check_model_paths

    try:
        check_model_paths(job.spec.model)  # before anything is created under --runs-dir
    except (FileNotFoundError, ModelLoadError) as exc:
        return refuse(str(exc))
    if port is not None:
        from daedalus_trainer.usage import UsageError, check_port_free

        try:  # a port the user chose: taken is an error now, not a silent other port minutes later
            check_port_free("127.0.0.1", port, "--port (or DAEDALUS_METRICS_PORT)")
        except UsageError as exc:
            return refuse(str(exc))
    start: str | LoadedCheckpoint = resume  # what the Trainer resumes from: the checkpoint is read once, here
    # The GRPO checkpoint to continue is read, verified and checked against this job now, not after SFT and an
    # evaluation (minutes, and an eval-before.json rewritten for settings the run then refuses), its adapter included
    # (the trainer moves the checkpoints it will not continue aside once it has accepted it). With `none`, the old
    # run's GRPO checkpoints go aside before SFT starts over, so that an interrupted run is never followed by a
    # `latest` resume of the old timeline on top of a new SFT model.
    from daedalus_trainer.checkpoint import CheckpointError, CheckpointManager
    from daedalus_trainer.grpo import resume_checkpoint

    try:
        loaded = resume_checkpoint(job, run_dir / "checkpoints", resume)
        if loaded is not None:
            _check_continuable(job, loaded, run_dir)
    except CheckpointError as exc:
        return refuse(f"--resume {resume}: {exc}")
    if loaded is not None:
        start = loaded
    elif resume == "none":
        CheckpointManager(run_dir / "checkpoints", keep=job.spec.checkpoint.keep).abandon_other_timelines(None)
    make_dir(run_dir, "--runs-dir")
    console.print(f"[bold]daedalus run[/bold] {escape(str(job_path))}: job [cyan]{job.metadata.name}[/cyan] -> "
                  f"{escape(str(run_dir))}/ "
                  "(local mode: spec.cluster is ignored)")

    from daedalus_trainer.grpo import SIGTERM_EXIT, Trainer, init_ray, stop_on_sigint, stop_on_sigterm
    from daedalus_trainer.server import TrainerServer

    # 1. the starting point
    start_dir = job.spec.model.sft_adapter
    if not start_dir:
        from daedalus_trainer import sft

        dagger = job.spec.sft.on_policy_fraction > 0
        console.rule("SFT on solver demonstrations" + (" and solver-labelled own states (DAgger)" if dagger else ""))
        # the evaluation right after replaces SFT's own final one
        start_dir = str(sft.run_sft(job, run_dir / "sft", resume=resume != "none", final_eval=False,
                                     warn_budget=False))  # _print_sft_summary says it, once
        _print_sft_summary(console, run_dir / "sft" / sft.REPORT_NAME)
    work_dir = run_dir
    # What evaluation loads: a full SFT model (tiny) with GRPO's fresh adapter on top, or the base model with the SFT
    # adapter (which GRPO trains further, so the exported adapter replaces it).
    from daedalus_trainer.policy import is_adapter_dir, resolve_base_dir

    start_is_adapter = is_adapter_dir(start_dir)
    if start_is_adapter:
        eval_model, start_adapter = str(resolve_base_dir(job.spec.model, work_dir)), start_dir
    else:
        eval_model, start_adapter = start_dir, None

    # 2. before
    before, before_training = _cached_evaluation(
        console, job, eval_model, start_adapter, run_dir, "before", use_cache=resume != "none",
        title="Evaluation of the starting point (held-out and training layouts)",
        stale="the starting point or the evaluation settings changed since eval-before.json was written: "
              "evaluating it again")

    # 3. GRPO
    console.rule("GRPO (LoRA) on a local Ray")
    import signal

    sigterm_before_ray = signal.getsignal(signal.SIGTERM)  # ray.init installs a handler that exits 15
    progress = _Progress(console, job.spec.algorithm.steps)
    trainer = Trainer(job, run_dir, start_dir=start_dir, work_dir=work_dir, on_step=progress.update,
                      on_resume=progress.resumed,
                      final_eval=False)  # the full before/after evaluation below replaces it
    if not trainer.nothing_to_train(loaded):  # a rerun of a finished run needs no Ray
        init_ray(local=True, rollout_workers=job.spec.algorithm.rollout_workers)
    port = _free_port(DEFAULT_PORT if port is None else port)
    with TrainerServer(trainer.metrics, trainer.control, host="127.0.0.1", port=port) as server:
        console.print(f"metrics and status: {server.url}/metrics  {server.url}/status  "
                      "(Ctrl-C: stop after this step, checkpointed; run again to resume)")
        with (progress, stop_on_sigint(trainer.control) as ctrl_c,
              stop_on_sigterm(trainer.control, ended_exit=SIGTERM_EXIT) as sigterm):
            result = trainer.train(resume=start)
    import ray

    ray.shutdown()
    if sigterm_before_ray is not None:  # the evaluation after GRPO: a SIGTERM ends it as before Ray (143 for a shell)
        signal.signal(signal.SIGTERM, sigterm_before_ray)
    why, code = (("interrupted (Ctrl-C)", 130) if ctrl_c.received else
                 ("stopped (SIGTERM)", SIGTERM_EXIT) if sigterm.received else
                 ("training stopped before the end", 0))
    if result.adapter_dir is None:
        ckpt = result.latest_checkpoint
        saved = f"checkpoint at step {ckpt.step}" if ckpt is not None else "no checkpoint yet"
        console.print(f"[yellow]{why}: {saved}; run the same command again to resume[/yellow]")
        return code
    if code:  # the signal came during the last step: training finished, the evaluation after it is what is left
        console.print(f"[yellow]{why} during the last step: training finished and its adapter is exported; the "
                      "evaluation after GRPO is skipped: run the same command again to evaluate and report[/yellow]")
        return code

    # 4. after (cached like the start's: a run that had nothing left to train evaluates nothing again)
    after, after_training = _cached_evaluation(
        console, job, eval_model, str(result.adapter_dir), run_dir, "after",
        title="Evaluation after GRPO (held-out and training layouts)")

    report = _report(job, before, after, result, time.perf_counter() - started,
                     training=(before_training, after_training))
    report_file = run_dir / "report.json"
    trained_nothing = result.resumed_from is not None and result.resumed_from >= result.steps_done
    # A rerun of a finished run: the timings that mean something are those of the call that trained.
    kept = _kept_timings(report_file, result.steps_done) if trained_nothing else None
    if kept is not None:
        report["wall_seconds"], report["grpo_wall_seconds"], report["grpo_resumed_from"] = kept
        console.print("nothing left to train: the timings below are those of the run that trained")
    from daedalus_trainer.checkpoint import atomic_write_json

    atomic_write_json(report_file, report)  # users read it as the result, and a rerun reads its timings back
    curves = _plot_curves(result.history, run_dir / "curves.png", before, after, (before_training, after_training),
                          job.spec.algorithm.mazes_per_step)

    corners = report["eval_corners"]
    episodes = (f"{report['eval_mazes']} mazes" if corners == 1 else
                f"{report['eval_mazes']} layouts x {corners} start/goal corner pairs")
    table = Table(title=f"{job.metadata.name}: held-out success ({episodes}, size {job.spec.environment.size}, "
                        "layouts unseen in training)")
    table.add_column("policy", no_wrap=True)
    table.add_column("greedy success", justify="right")
    table.add_column("95% CI", justify="right", no_wrap=True)
    table.add_column("sampled success", justify="right")
    table.add_column("mean turns", justify="right")
    table.add_column("greedy, training layouts", justify="right")
    n_training = _greedy(after_training)["episodes"]
    table.caption = f"last column: greedy, {n_training} training-layout mazes, 1 corner pair each"
    for name, ev, ev_training in (("SFT start", before, before_training), ("after GRPO", after, after_training)):
        g = _greedy(ev)
        s = _sampled(ev)
        table.add_row(name, f"{g['success_rate']:.1%}", f"[{g['ci_low']:.1%}, {g['ci_high']:.1%}]",
                      f"{s['success_rate']:.1%}" if s else "-", f"{g['mean_turns']:.1f}",
                      f"{_greedy(ev_training)['success_rate']:.1%}")
    console.print(table)
    gain = report["gain"]
    if gain is not None:
        pairs = "layouts" if corners > 1 else "mazes"
        console.print(f"held-out greedy gain: {100 * gain['gain']:+.1f} points, 95% CI [{100 * gain['ci_low']:+.1f}, "
                      f"{100 * gain['ci_high']:+.1f}] (the same {gain['episodes']} episodes before and after, "
                      f"bootstrap over {pairs}); {gain['fixed']} episodes fixed, {gain['broken']} broken")
    silent = [h["step"] for h in result.history if h.get("zero_variance_groups") == job.spec.algorithm.mazes_per_step]
    if silent and not job.spec.algorithm.step_advantage_weight:  # turn-level advantages learn from such groups too
        every = len(silent) == len(result.history)
        console.print(f"[yellow]{'every one' if every else len(silent)} of the {len(result.history)} GRPO steps had no "
                      "group whose episodes differed in reward: nothing to learn from"
                      + (" (a stronger SFT start, a larger algorithm.groupSize or easier mazes give GRPO both outcomes "
                         "to compare)" if every else "") + "[/yellow]")
    console.print(f"{grpo_summary(report)}  whole run: {report['wall_seconds']:.0f} s  "
                  f"adapter: {escape(_shown(result.adapter_dir))}  curves: {escape(_shown(curves))}  "
                  f"report: {escape(_shown(run_dir / 'report.json'))}")
    return 0


def grpo_summary(report: dict[str, Any]) -> str:
    """The GRPO part of `daedalus run`'s closing line, from ``report.json``'s ``steps``, ``grpo_wall_seconds``
    (seconds) and ``grpo_resumed_from`` (the step the call that trained resumed from, or null): "GRPO steps: 48 in
    301 s", or, for a run that resumed, how many of the steps that call trained, e.g. "GRPO steps: 48, the last 20 in
    130 s (resumed from step 28)", so that a resumed run's seconds are not read as the whole run's."""
    resumed = report.get("grpo_resumed_from")
    if not resumed:
        return f"GRPO steps: {report['steps']} in {report['grpo_wall_seconds']:.0f} s"
    return (f"GRPO steps: {report['steps']}, the last {report['steps'] - resumed} in "
            f"{report['grpo_wall_seconds']:.0f} s (resumed from step {resumed})")


def _print_sft_summary(console, report_path: Path) -> None:
    """One line on the SFT starting point from its ``sft_report.json``: steps of the step budget, seconds, and a
    warning when ``sft.maxSeconds`` ended it first (the start then depends on the machine's speed)."""
    if not report_path.is_file():
        return
    rep = json.loads(report_path.read_text())
    budget = (rep.get("settings") or {}).get("steps")
    line = f"SFT: {rep.get('steps')} of {budget} steps in {rep.get('seconds', 0):.0f} s"
    if budget and rep.get("steps", 0) < budget:
        max_seconds = (rep.get("settings") or {}).get("max_seconds", 0)
        line = (f"[yellow]{line}: stopped by sft.maxSeconds ({max_seconds:.0f} s) on this machine, so the start "
                "(and every figure after it) follows this machine's speed; sft.maxSeconds: 0 trains all "
                f"{budget} steps[/yellow]")
    console.print(line)


def _shown(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies below it (shorter on a terminal), else absolute."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _mode(ev: dict, mode: str) -> dict | None:
    """The ``results`` entry of ``mode`` in an :class:`~daedalus_trainer.evaluation.EvalReport` dict."""
    return next((r for r in ev.get("results", []) if r["mode"] == mode), None)


def _greedy(ev: dict) -> dict:
    return _mode(ev, "greedy")


def _sampled(ev: dict) -> dict | None:
    return _mode(ev, "sampled")


def _report(job, before: dict, after: dict, result, wall: float, training: tuple[dict, dict]) -> dict[str, Any]:
    """The figures of ``report.json``: ``success_before``/``success_after`` (greedy, held-out), their 95% intervals
    ``ci95_before``/``ci95_after`` (Wilson; on the design-effect sample size with ``evalCorners`` > 1), ``steps``,
    ``wall_seconds`` (keys fixed by the GRPO issue), ``gain`` (:func:`~daedalus_trainer.evaluation.paired_gain` of
    the greedy held-out episodes: ``gain``, ``ci_low``, ``ci_high`` as fractions, episodes ``fixed``/``broken``;
    None when an evaluation lacks per-episode outcomes), ``eval_mazes`` (layouts) and ``eval_corners``, sampled
    success, GRPO seconds (``grpo_wall_seconds``, of the call that trained: with ``grpo_resumed_from`` set, the
    steps after that one), ``training_success_before``/``training_success_after`` (greedy on training layouts, from
    ``training`` = the before/after evaluations there); the full evaluation reports under ``before``, ``after``,
    ``before_training``, ``after_training`` (their ``model_path``/``adapter_path`` absolute, see
    :func:`_cached_evaluation`); ``adapter``, the absolute path of the exported adapter."""
    from daedalus_trainer.evaluation import paired_gain

    g_before, g_after = _greedy(before), _greedy(after)
    corners = int(g_after.get("corners", 1))
    gain = (paired_gain(g_before["outcomes"], g_after["outcomes"], corners)
            if g_before.get("outcomes") and g_after.get("outcomes") else None)
    return {
        "job": job.metadata.name,
        "success_before": _greedy(before)["success_rate"],
        "success_after": _greedy(after)["success_rate"],
        "ci95_before": [_greedy(before)["ci_low"], _greedy(before)["ci_high"]],
        "ci95_after": [_greedy(after)["ci_low"], _greedy(after)["ci_high"]],
        "sampled_success_before": (_sampled(before) or {}).get("success_rate"),
        "sampled_success_after": (_sampled(after) or {}).get("success_rate"),
        "gain": gain,
        "eval_mazes": g_after["episodes"] // corners,
        "eval_corners": corners,
        "eval_episodes": g_after["episodes"],
        "steps": result.steps_done,
        "wall_seconds": wall,
        "grpo_wall_seconds": result.wall_seconds,
        "grpo_resumed_from": result.resumed_from,
        "adapter": os.path.abspath(result.adapter_dir),
        "before": before,
        "after": after,
        "training_success_before": _greedy(training[0])["success_rate"],
        "training_success_after": _greedy(training[1])["success_rate"],
        "before_training": training[0],
        "after_training": training[1],
    }


def _plot_curves(history: list[dict], out: Path, before: dict, after: dict, training: tuple[dict, dict],
                 mazes: int) -> Path:
    """PNG of rollout success (each step and its 8-step mean) and reward, turns per episode, and the groups of
    ``mazes`` per step whose rewards differ (the ones GRPO learns from), with greedy success on the held-out
    layouts (``before``/``after``) and on the training layouts (``training``: the evaluations there) as points at
    step 0 (the SFT start) and at the last step, values written beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    success = [h["success_ratio"] for h in history]
    axes[0].plot(steps, success, color="tab:blue", alpha=0.35, lw=0.8, label="rollout success")
    window = 8
    if len(success) >= window:
        rolling = [sum(success[i - window + 1 : i + 1]) / window for i in range(window - 1, len(success))]
        axes[0].plot(steps[window - 1 :], rolling, color="tab:blue", label=f"rollout success, mean of {window} steps")
    rewards = [h["reward_mean"] for h in history]
    if any(abs(r - x) > 1e-9 for r, x in zip(rewards, success)):  # with the sparse 0/1 reward they are the same line
        axes[0].plot(steps, rewards, "--", color="tab:gray", lw=0.8, label="reward mean")
    # greedy evaluations: the SFT start at step 0 and the result at the last step, joined, each value written next
    # to its point (as horizontal lines, two evaluations with close values hid each other)
    last = steps[-1] if steps else 1
    for (ev0, ev1), color, marker, name, dy in (((before, after), "tab:green", "o", "held-out greedy", -1),
                                                (training, "tab:orange", "s", "training layouts greedy", 1)):
        ys = (_greedy(ev0)["success_rate"], _greedy(ev1)["success_rate"])
        axes[0].plot((0, last), ys, color=color, marker=marker, ms=5, lw=1.2, ls="--",
                     label=f"{name}: SFT {100 * ys[0]:.1f}% -> {100 * ys[1]:.1f}%")
        for x, y, ha in ((0, ys[0], "left"), (last, ys[1], "right")):
            axes[0].annotate(f"{100 * y:.1f}%", (x, y), xytext=(0, 7 * dy), textcoords="offset points",
                             ha=ha, va="center", fontsize=7, color=color,
                             bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_xlabel("GRPO step")
    axes[0].legend(fontsize=7)
    axes[0].set_title("success")
    axes[1].plot(steps, [h["episode_turns"] for h in history])
    axes[1].set_xlabel("GRPO step")
    axes[1].set_title("turns per episode")
    # GRPO learns only from groups whose episodes differ in reward (a group all solved or all failed has zero
    # advantages); the loss itself is ~0 by construction (advantages are centred per group) and says little.
    mixed = [(h["step"], mazes - h["zero_variance_groups"]) for h in history
             if h.get("zero_variance_groups") is not None]
    if mixed:
        axes[2].plot(*zip(*mixed), color="tab:purple")
    axes[2].set_ylim(0, mazes + 0.5)
    axes[2].set_xlabel("GRPO step")
    axes[2].set_title(f"groups (of {mazes}) with mixed rewards")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


class _Progress:
    """A rich progress bar fed by the trainer's per-step records."""

    def __init__(self, console, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]GRPO[/bold]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=console, transient=False,
        )
        self.task = self.progress.add_task("grpo", total=total, info="")
        self.console, self.total = console, total
        #: Without a terminal (output redirected to a log) the bar is drawn only at the end: a plain line every
        #: ``every`` steps instead.
        self.every = 0 if console.is_terminal else max(1, total // 12)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def resumed(self, step: int) -> None:
        """Start the bar at the checkpoint's ``step`` (its time estimate from the steps trained from here on)."""
        self.progress.reset(self.task, completed=step, info="")
        # reset() leaves the task unfinished even at its total (the time column then shows -:--:-- for a finished
        # run's rerun); update() marks it finished there, and adds no speed sample for the steps already done
        self.progress.update(self.task, completed=step)
        self.console.print(f"resumed from the checkpoint at step {step}")  # above a live bar, or a line in a log

    def update(self, rec: dict) -> None:
        secs = rec["rollout_seconds"] + rec["learner_seconds"]
        info = (f"reward {rec['reward_mean']:.2f}  success {rec['success_ratio']:.0%}  "
                f"turns {rec['episode_turns']:.1f}  {rec['rollout_tokens'] / max(secs, 1e-9):.0f} tok/s")
        self.progress.update(self.task, completed=rec["step"], info=info)
        if self.every and (rec["step"] % self.every == 0 or rec["step"] == self.total):
            self.console.print(f"GRPO step {rec['step']}/{self.total}: {info}")
