"""``judge calibrate`` and ``judge evaluate``: fit a profile on a labeled task, then measure it.

Both judge one split of a task directory (see ``tasks.files``) through ``tasks.judge_task_items``,
the same path the service's fit endpoint and the calibration benchmark take. ``calibrate``
fits with ``tasks.fit_labeled`` and writes the profile, a markdown report and a reliability
diagram; ``evaluate`` measures the served policy, every gate included, on held-out items
with ``calibration.evaluate_policy``. Both say whether the judge beats the label prior.

``calibrate --unlabeled contextual|batch`` fits a label-free prior correction instead: from
content-free inputs in the task's prompt (contextual), or from the split's texts with their
labels ignored, or the prompts of ``--input`` (batch); see ``calibration.maps.label_free``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from calibration import MIN_EXAMPLES, Provenance
from calibration.maps.map_types import Probe, ProbeSpan
from calibration.maps.probe import MIN_PROBE_EXAMPLES, candidate_layers
from calibration.profile import NAME_PATTERN, save_profile
from calibration.tasks import (
    LabeledItem,
    LabeledItems,
    LabeledScores,
    Task,
    content_free_prompts,
    count_look,
    fit_adapter_profile,
    fit_labeled,
    fit_unlabeled,
    judge_task_items,
    judge_unlabeled,
    load_prompts,
    load_split,
    load_task,
    read_looks,
    task_prompt,
    task_template,
    taught_items,
)
from judge import Engine
from judge.atomicio import write_text
from service.cli.profile_files import kept_instead, save_fitted
from service.command_line import (
    UsageError,
    fit_settings,
    load_engine,
    load_profile,
    open_probability,
    positive_int,
    probability,
    profiles_dir_argument,
    task_arguments,
    to_json,
)
from service.install import missing_adapter_extra

if TYPE_CHECKING:
    from calibration.certificates.recertify import Recertification

__all__ = [
    "add_arguments",
    "fit_settings",
    "run",
    "run_calibrate",
    "run_evaluate",
]


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge calibrate``'s (``--task``, or ``--from-log``) and ``judge evaluate``'s."""
    fit = commands.add_parser(
        "calibrate", help="fit a calibration profile on a task's labeled data"
    )
    source = fit.add_mutually_exclusive_group(required=True)
    task_arguments(fit, split="calibration", either=source)
    source.add_argument(
        "--from-log",
        metavar="LOG",
        help="instead of --task: refit --profile on the labeled decisions of this decision "
        "log (a SQLite file or a postgresql:// URL), from their logged scores: the audited "
        "ones certify, the others only fit",
    )
    fit.add_argument(
        "--profile", help="with --from-log: the profile to refit (a name in --profiles-dir)"
    )
    fit.add_argument("--name", help="profile name (default: the task's name)")
    profiles_dir_argument(fit)
    fit.add_argument(
        "--target-precision",
        type=open_probability,
        default=0.9,
        help="precision to certify on accepted items",
    )
    fit.add_argument(
        "--delta", type=open_probability, default=0.1, help="allowed failure probability"
    )
    fit.add_argument(
        "--per-class",
        action="store_true",
        help="certify a threshold per predicted class (each class's accepted decisions at least "
        "the target precise, every class at once with probability 1 - delta) and serve that "
        "rule; a class that certifies none escalates its decisions",
    )
    fit.add_argument(
        "--alpha", type=open_probability, default=0.1, help="conformal miscoverage level"
    )
    fit.add_argument(
        "--max-std",
        type=_std_bound,
        help="score tasks: escalate when the calibrated std of the value exceeds this",
    )
    fit.add_argument(
        "--method",
        choices=["auto", "temperature", "bias_temperature", "probe", "adapter"],
        help="the calibration map: auto (default) chooses between temperature, "
        "bias_temperature and probe (a learned head on the model's hidden state) by "
        f"cross-validated NLL; the probe is tried from {MIN_PROBE_EXAMPLES} labeled examples; "
        "adapter: low-rank adapters (LoRA) trained under the probe's head on the fit split, "
        "served merged in the same pass, kept where they beat auto's choice on a validation "
        "fold (minutes, not seconds)",
    )
    adapter = fit.add_argument_group("--method adapter")
    adapter.add_argument(
        "--epochs",
        type=positive_int,
        default=6,
        help="training epochs (default 6): the learning rate decays to zero over them; a "
        "validation fold may stop it sooner",
    )
    adapter.add_argument(
        "--adapter-blocks",
        type=positive_int,
        default=10,
        help="decoder blocks adapted, just below the layer the head reads (default 10)",
    )
    adapter.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    adapter.add_argument(
        "--max-minutes",
        type=float,
        default=15.0,
        help="training stops after the epoch that passes this (default 15)",
    )
    adapter.add_argument(
        "--keep-adapter",
        action="store_true",
        help="certify the adapter even where the probe beats it on the validation fold "
        "(default: keep what wins, and say so)",
    )
    fit.add_argument(
        "--methods",
        nargs="+",
        choices=["temperature", "batch_temperature", "bias_temperature", "probe"],
        help="instead of --method: the labeled candidates chosen between by cross-validated NLL",
    )
    fit.add_argument(
        "--unlabeled",
        nargs="?",
        const="batch",
        choices=["contextual", "batch"],
        help="fit a label-free prior correction instead: contextual (content-free inputs in "
        "the task's prompt) or batch (default: the split's texts, labels ignored, or --input)",
    )
    fit.add_argument(
        "--input",
        type=Path,
        help='with --unlabeled batch: a JSONL file of unlabeled prompts, {"prompt": ...} a line',
    )
    fit.set_defaults(run=run)

    ev = commands.add_parser(
        "evaluate", help="measure the served policy of a profile on a held-out split"
    )
    task_arguments(ev, split="test", dtype=False)
    ev.add_argument("--profile", type=Path, required=True, help="a profile JSON file")
    ev.add_argument("--threshold", type=probability, help="evaluate with this threshold instead")
    ev.add_argument(
        "--min-choice-mass", type=probability, help="evaluate with this minimum choice mass"
    )
    ev.add_argument(
        "--max-std", type=_std_bound, help="evaluate with this bound on a score's std instead"
    )
    ev.add_argument("--report", type=Path, help="also write a markdown report here")
    ev.add_argument("--json", type=Path, help="also write the evaluation as JSON here")
    ev.set_defaults(run=run_evaluate)


def _std_bound(text: str) -> float:
    """An argparse type for a bound on a score's std: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """``judge calibrate``: on a task's labeled split, or (--from-log) on the decision log."""
    if args.from_log is not None:
        from service.cli import log

        return log.run_from_log(args)
    return run_calibrate(args)


def run_calibrate(args: argparse.Namespace) -> int:
    # Here, as each command's fitting and plotting: `judge --help` runs without scipy.
    from calibration.report import (
        class_certificate_lines,
        metrics_table,
        next_steps,
        signal_markdown,
    )

    task = load_task(args.task)
    name = args.name or task.name
    if not re.fullmatch(NAME_PATTERN, name):
        raise UsageError(
            f"profile name {name!r} must match {NAME_PATTERN} (pass --name to choose one)"
        )
    if args.unlabeled is not None or args.input is not None:
        return _calibrate_unlabeled(args, task, name)
    items, digest = load_split(task, args.split, args.limit)
    if len(items) < MIN_EXAMPLES:
        limited = f" with --limit {args.limit}" if args.limit else ""
        raise UsageError(
            f"{task.name}/{args.split} has {len(items)} items{limited}; a calibration profile "
            f"needs at least {MIN_EXAMPLES} labeled examples"
        )
    if args.method == "adapter":
        return _calibrate_adapter(args, task, name, items, digest)
    settings = fit_settings(args, values=task.values, max_std=args.max_std)
    methods = settings.methods
    if "probe" in methods and methods != "auto" and len(items) < MIN_PROBE_EXAMPLES:
        raise UsageError(
            f"method probe needs at least {MIN_PROBE_EXAMPLES} labeled examples, and "
            f"{task.name}/{args.split} has {len(items)}: use --method auto (temperature "
            "scaling below that) or give more examples"
        )
    engine = load_engine(args, dtype=args.dtype)
    # The probe's candidate layers come from the same passes; nothing is asked otherwise.
    fingerprint = engine.fingerprint()
    num_layers = fingerprint.num_layers
    layers = (
        candidate_layers(num_layers)
        if num_layers and (methods == "auto" or "probe" in methods)
        else ()
    )
    # Their means over each item's own text too: the probe may read those instead.
    scores = _judge_items(
        engine, task, args.split, items, task.choices, args.batch_size, layers, layers
    )
    taught = taught_items(items)  # chosen to teach (judge label --queue --items): fit only
    scores = dataclasses.replace(scores, fit_only=taught)
    look = _look(task, args.split, settings.delta)
    if look is not None:
        print(
            f"{task.name}/{args.split} is a labelling queue's split: this is look {look.look} "
            f"of its lineage, certified at delta {look.spent:.3g}, its share of {look.delta:g}"
        )
        settings = msgspec.structs.replace(settings, delta=look.spent)
    provenance = Provenance(
        fingerprint=fingerprint,
        dataset=f"{task.name}/{args.split}",
        dataset_sha256=digest,
        template=task_template(task),  # so that judge ask --profile takes the item alone
        recertification=look,
    )
    profile = fit_labeled(name, scores, task.choices, provenance, settings).profile
    out = args.profiles_dir
    kept = kept_instead(profile, out / f"{name}.json")
    if kept is None:
        save_fitted(profile, scores, taught, out)
    fitted = profile.calibration_map
    if isinstance(fitted, Probe):
        print(
            f"profile {name}: method probe, layer(s) {fitted.layers} of {fitted.num_layers} "
            f"({fitted.reads})"
        )
    else:
        print(f"profile {name}: method {fitted.method}, temperature {fitted.temperature:.4f}")
    print(profile.note)
    print(signal_markdown(profile.signal))
    assert profile.metrics_before is not None and profile.metrics_after is not None  # labeled
    print(metrics_table(profile.metrics_before, profile.metrics_after))
    if profile.baseline is not None:
        print(f"the scalar maps on the same split: {profile.baseline.note}")
        base = profile.baseline.metrics_after
        print(
            f"accuracy {base.accuracy.value:.3f} vs {profile.metrics_after.accuracy.value:.3f} "
            f"for the probe; NLL {base.nll.value:.4f} vs {profile.metrics_after.nll.value:.4f}; "
            "certified threshold "
            + (
                "none"
                if profile.baseline.threshold.threshold is None
                else f"{profile.baseline.threshold.threshold:.3f}"
            )
        )
    t = profile.threshold
    if t.threshold is not None:
        print(f"threshold: {t.threshold:.3f}, coverage {t.coverage:.3f} (on the certify split)")
    else:
        print(f"no certified threshold: {t.reason}")
    for line in class_certificate_lines(profile):
        print(line.replace("**", ""))
    for line in next_steps(profile):
        print(f"next: {line}")
    print(kept or f"wrote {out / name}.json, .report.md, .reliability.png")
    return 0


def _look(task: Task, split: str, delta: float) -> Recertification | None:
    """Where ``split`` has a lineage of looks (the labelling queue began one on it), the next
    look, counted before its certificate is read; else None: one fit, at the full delta."""
    looks = read_looks(task, split, delta)
    if looks is None:
        return None
    count_look(task, split, looks)
    return looks.next(str(Path(task.path) / f"{split}.jsonl"))


def _calibrate_adapter(
    args: argparse.Namespace, task: Task, name: str, items: list[LabeledItem], digest: str
) -> int:
    """``--method adapter``: a probe on the fit split, adapters trained under its head, the
    head certified on the items neither saw (``calibration.tasks.fit_adapter_profile``)."""
    from tqdm import tqdm

    from calibration.report import metrics_table, profile_markdown
    from calibration.tasks.adapter.training import AdapterSettings
    from judge import Judge

    if (missing := missing_adapter_extra()) is not None:
        raise UsageError(f"--method adapter: {missing}")
    if len(items) < MIN_PROBE_EXAMPLES:
        raise UsageError(
            f"method adapter needs at least {MIN_PROBE_EXAMPLES} labeled examples (it starts "
            f"from a probe), and {task.name}/{args.split} has {len(items)}"
        )
    if not args.max_minutes > 0:
        raise UsageError(f"--max-minutes must be a positive number, got {args.max_minutes}")
    engine = load_engine(args, dtype=args.dtype)
    if not isinstance(engine, Judge):
        raise UsageError(
            f"--method adapter trains on the model's own weights; {args.model} is served "
            "elsewhere: load the model here (a Hugging Face id, a directory or a GGUF)"
        )
    # The adapter's rival is auto's choice between the scalar maps and the probe.
    settings = msgspec.structs.replace(
        fit_settings(args, values=task.values, max_std=args.max_std), methods="auto"
    )
    adapter_settings = AdapterSettings(
        blocks=args.adapter_blocks,
        rank=args.rank,
        epochs=args.epochs,
        max_seconds=args.max_minutes * 60,
        seed=settings.seed,
    )
    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=f"{task.name} {stage}", file=sys.stderr)
        bar.update(done - bar.n)  # tqdm shows the time left from the rate so far
        if done >= total:
            bar.close()

    fitted = fit_adapter_profile(
        engine,
        task,
        LabeledItems(items, f"{task.name}/{args.split}", digest),
        name,
        settings=settings,
        adapter_settings=adapter_settings,
        batch_size=args.batch_size,
        progress=progress,
        keep_adapter=args.keep_adapter,
    )
    profile, rival = fitted.profile, fitted.rival
    out = args.profiles_dir
    save_profile(profile, out / f"{name}.json")
    write_text(out / f"{name}.report.md", profile_markdown(profile))
    nll = fitted.validation_nll
    kept = "adapter" if profile.adapter else profile.calibration_map.method
    versus = rival.calibration_map.method
    print(
        f"profile {name}: {kept} kept ({fitted.winner} won on the validation fold); "
        f"{fitted.fit.note}; validation NLL adapter {nll['adapter']:.4f}, {versus} "
        f"{nll['rival']:.4f}"
    )
    assert profile.metrics_before is not None and profile.metrics_after is not None
    print(metrics_table(profile.metrics_before, profile.metrics_after))
    for label, p in ((f"profile ({kept})", profile), (f"{versus} on the same split", rival)):
        assert p.metrics_after is not None
        t = p.threshold
        certified = (
            f"threshold {t.threshold:.3f}, coverage {t.coverage:.3f}"
            if t.threshold is not None
            else f"no certified threshold ({t.reason})"
        )
        print(
            f"{label}: held-out accuracy {p.metrics_after.accuracy.value:.3f}, "
            f"ECE {p.metrics_after.ece.value:.3f}; {certified}"
        )
    print(f"wrote {out / name}.json ({(out / f'{name}.json').stat().st_size} bytes), .report.md")
    return 0


def _calibrate_unlabeled(args: argparse.Namespace, task: Task, name: str) -> int:
    """``calibrate --unlabeled``: a label-free profile; every input checked before the model."""
    from calibration.report import profile_markdown, signal_markdown

    method = args.unlabeled or "batch"
    if args.input is not None and method != "batch":
        raise UsageError("--input gives unlabeled prompts for --unlabeled batch, not contextual")
    if method == "contextual":
        prompts = content_free_prompts(task)
        digest = hashlib.sha256("\x00".join(prompts).encode()).hexdigest()
        dataset = f"{task.name}/content-free"
        source = "content-free inputs 'N/A', '', '[MASK]' in place of the item text"
    elif args.input is not None:
        prompts, digest = load_prompts(args.input)
        dataset = str(args.input)
        source = f"the {len(prompts)} prompts of {args.input}"
        if not prompts:
            raise UsageError(
                f"--input {args.input} holds no prompts; batch calibration needs at least one "
                'unlabeled prompt ({"prompt": "..."} per line)'
            )
    else:
        items, digest = load_split(task, args.split, args.limit)
        prompts = [task_prompt(task, item.text) for item in items]
        dataset = f"{task.name}/{args.split}"
        source = f"the {len(prompts)} texts of {dataset}, labels ignored"
        if not prompts:
            raise UsageError(
                f"--unlabeled batch: {dataset} has no items; batch calibration needs at least "
                "one unlabeled input (or give --input prompts.jsonl)"
            )
    engine = load_engine(args, dtype=args.dtype)
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc=dataset, unit="item", file=sys.stderr) as bar:
        z = judge_unlabeled(
            engine, prompts, task.choices, batch_size=args.batch_size, progress=bar.update
        )
    profile = fit_unlabeled(
        name,
        z,
        task.choices,
        engine.fingerprint(),
        method=method,
        source=source,
        dataset=dataset,
        dataset_sha256=digest,
        settings=fit_settings(args, values=task.values, max_std=args.max_std),
    )
    out = args.profiles_dir
    save_profile(profile, out / f"{name}.json")
    write_text(out / f"{name}.report.md", profile_markdown(profile))
    print(f"profile {name}: label-free {method} calibration on {len(prompts)} inputs")
    print(profile.note)
    print(signal_markdown(None, label_free=True))
    print(f"no certified threshold: {profile.threshold.reason}")
    print(f"wrote {out / name}.json, .report.md")
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from calibration import evaluate_policy
    from calibration.report import evaluation_markdown, profile_markdown

    profile = load_profile(args.profile)
    task = load_task(args.task)
    items, _ = load_split(task, args.split, args.limit)
    engine = load_engine(args, profile)
    # Before any item is judged: the task's choices and the engine must be the profile's.
    profile.check(engine.fingerprint(), choices=task.choices)
    probe = profile.calibration_map
    layers = probe.layers if isinstance(probe, Probe) else []
    scores = _judge_items(
        engine,
        task,
        args.split,
        items,
        profile.choices,
        args.batch_size,
        layers,
        profile.span_layers,
        probe.span if isinstance(probe, Probe) and probe.span else "item",
    )
    evaluation = evaluate_policy(
        profile,
        scores.log_probabilities,
        scores.labels,
        scores.choice_mass,
        threshold=args.threshold,
        min_choice_mass=args.min_choice_mass,
        max_std=args.max_std,
        features=scores.features,
        span_features=scores.span_features,
    )
    print(evaluation_markdown(evaluation))
    if args.report:
        write_text(args.report, profile_markdown(profile, evaluation))
    if args.json:
        write_text(args.json, to_json(evaluation, indent=2) + "\n")
    return 0


def _judge_items(
    engine: Engine,
    task: Task,
    split: str,
    items: Sequence[LabeledItem],
    choices: Sequence[str],
    batch_size: int,
    feature_layers: Sequence[int] = (),
    span_layers: Sequence[int] = (),
    span: ProbeSpan = "item",
) -> LabeledScores:
    """Judge ``items`` of ``task`` with a progress bar; score columns in ``choices`` order,
    with the hidden states of ``feature_layers`` and the means of ``span_layers`` over each
    item's ``span``."""
    from tqdm import tqdm

    with tqdm(total=len(items), desc=f"{task.name}/{split}", unit="item", file=sys.stderr) as bar:
        return judge_task_items(
            engine,
            task,
            items,
            choices=choices,
            batch_size=batch_size,
            progress=bar.update,
            feature_layers=feature_layers,
            span_layers=span_layers,
            span=span,
        )
