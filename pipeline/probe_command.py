"""`elmo-pipeline probe`: train and evaluate a classifier on the pipeline's vectors, per layer setting.

    elmo-pipeline probe --train out/sst2/train --dev out/sst2/dev --test out/sst2/test \
        --labels data/train.jsonl --labels data/dev.jsonl --labels data/test.jsonl --out probe/sst2 --threads 1

Writes OUT/table.md, OUT/results.json and OUT/chart.png. See downstream/probe.py for the models.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elmo_pipeline.formats.layout import FORMATS
    p.add_argument("--train", required=True, help="pipeline output folder (path or URL) with the training sentences")
    p.add_argument("--dev", help="output folder for model selection (best epoch by dev accuracy)")
    p.add_argument("--test", help="output folder to report on")
    p.add_argument("--labels", action="append", default=[],
                   help="labels for all splits (repeatable, merged): JSONL {id, label}, TSV 'key<TAB>label', "
                        "'label' per line (= input line number), or CoNLL-U for --task token")
    for s in ("train", "dev", "test"):
        p.add_argument(f"--{s}-labels", help=f"labels of the {s} split only (same formats as --labels)")
    p.add_argument("--id-field", default="id", help="JSONL labels: id field (a document or sentence id)")
    p.add_argument("--label-field", default="label", help="JSONL labels: label field")
    p.add_argument("--tag-column", default="upos", help="CoNLL-U column with the token tags (upos, xpos, deprel, ...)")
    p.add_argument("--task", choices=("sentence", "token"), default="sentence")
    p.add_argument("--classifier", choices=("mlp", "bilstm", "linear"), default="mlp",
                   help="sentence task: mean-pooled mix -> MLP, BiLSTM over the token vectors, or mean-pooled mix -> "
                        "linear (a logistic regression)")
    p.add_argument("--combine", default="trainable,frozen,learned",
                   help="layer combinations that 'mix' in --settings expands to: trainable (scalar mix, trained "
                        "weights), frozen (random fixed weights), learned (per-token MLP over all layers)")
    p.add_argument("--settings", default="layers,mix",
                   help="comma list: layer<K>, 'layers' (every layer alone), mix-<combination>, 'mix' (every --combine)")
    p.add_argument("--format", choices=FORMATS, help="which output format to read (default: parquet if written)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=256, help="MLP hidden size; BiLSTM: 2 x hidden/2")
    p.add_argument("--dropout", type=float, default=0.3, help="adam only (default 0.3)")
    p.add_argument("--optimizer", choices=("auto", "lbfgs", "adam"), default="auto",
                   help="auto (default): full-batch L-BFGS for a linear head (--task token, --classifier linear) on a "
                        "linear combination (single layers, trainable/frozen mixes): a logistic regression fitted to "
                        "convergence, no dropout, dev accuracy checked every 25 iterations (at most --epochs checks); "
                        "adam (minibatch, --lr, --dropout, --epochs) otherwise")
    p.add_argument("--l2", type=float, default=0.0, help="lbfgs: l2 penalty on the head's weights (default 0)")
    p.add_argument("--no-standardize", dest="standardize", action="store_false",
                   help="feed the layers as stored (default: z-score each layer's features with training-token statistics)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="repeat each setting with seeds seed..seed+N-1; report mean and std")
    from elmo_pipeline.pipeline.validate import local_path
    p.add_argument("--out", required=True, type=local_path("folder"),
                   help="folder for table.md, results.json, chart.png (a local path)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--storage-options", help="JSON fsspec options for object-store outputs, e.g. '{\"endpoint_url\": ...}'")
    p.add_argument("--quiet", action="store_true", help="no per-epoch log")


def _sort_classes(values) -> list[str]:
    vals = sorted(set(values))
    return sorted(vals, key=int) if all(v.lstrip("-").isdigit() for v in vals) else vals


def load_splits(args: argparse.Namespace, log) -> tuple[dict, list[str], int, int]:
    """{split name: downstream.probe.Split}, classes, n_layers, dim."""
    from elmo_pipeline.downstream.labels import conllu_tag_labels, load_sentence_labels, read_conllu
    from elmo_pipeline.downstream.splits import Split
    from elmo_pipeline.downstream.readers import ElmoDataset, ElmoOutput

    so = json.loads(args.storage_options) if args.storage_options else None

    def read_labels(path):
        if args.task == "token":
            return conllu_tag_labels(read_conllu(path, args.tag_column, so))
        return load_sentence_labels(path, args.id_field, args.label_field, so)

    shared = {}
    for path in args.labels:
        shared.update(read_labels(path))
    raw = {}
    for name in ("train", "dev", "test"):
        folder = getattr(args, name)
        if not folder:
            continue
        own = getattr(args, f"{name}_labels")
        labels = read_labels(own) if own else shared
        if not labels:
            raise ValueError(f"no labels for the {name} split: give --labels or --{name}-labels")
        out = ElmoOutput(folder, so)
        ds = ElmoDataset(out, fmt=args.format, labels=labels, label_key="tags" if args.task == "token" else "label")
        if args.task == "token":   # keep sentences whose tokens are the CoNLL-U forms
            keep, bad = [], 0
            for r in ds.records:
                if r["tags"]["forms"] == r["tokens"]:
                    r["tags"] = r["tags"]["tags"]
                    keep.append(r)
                else:
                    bad += 1
            if bad:
                log(f"{name}: {bad} sentences dropped, their tokens differ from the CoNLL-U forms")
            ds.records, ds._source = keep, [0] * len(keep)
        log(f"{name}: {len(ds)} labelled sentences from {folder} ({ds.unlabelled} without a label)")
        if not len(ds):
            first = next(out.sentences(args.format), {"id": "(none)"})["id"]
            raise ValueError(f"{name}: no sentence of {folder} has a label; its sentence ids look like {first!r}, "
                             f"labels are looked up by sentence id, document id or input line number")
        raw[name] = (out, ds)
    if "train" not in raw:
        raise ValueError("--train is required")
    values = [v for r in raw["train"][1].records for v in (r["tags"] if args.task == "token" else [r["label"]])]
    classes = _sort_classes(values)
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for name, (out, ds) in raw.items():
        recs, unknown = [], 0
        for i in range(len(ds)):
            r = ds[i]
            if args.task == "token":
                if any(t not in index for t in r["tags"]):
                    unknown += 1
                    continue
                r["tags"] = [index[t] for t in r["tags"]]
            else:
                if r["label"] not in index:
                    unknown += 1
                    continue
                r["label"] = index[r["label"]]
            recs.append(r)
        if unknown:
            log(f"{name}: {unknown} sentences dropped, labels unseen in train")
        splits[name] = Split(name, recs).prepare(args.task)
    out = raw["train"][0]
    return splits, classes, len(out.layer_names), out.dim


def run(args: argparse.Namespace) -> int:
    import torch

    from elmo_pipeline.downstream.combine import expand_settings
    from elmo_pipeline.downstream.metrics import majority_baseline
    from elmo_pipeline.downstream.probe import ProbeConfig, train_setting
    from elmo_pipeline.downstream.report import summarize, write_report
    if args.threads:
        torch.set_num_threads(args.threads)
    from elmo_pipeline.fsio import redact

    def say(m: str) -> None:            # the folders it names may be URLs with credentials: redacted
        print(redact(m), file=sys.stderr, flush=True)

    log = (lambda m: None) if args.quiet else say
    t0 = time.perf_counter()
    try:
        from elmo_pipeline.downstream.report import check_report_folder
        check_report_folder(args.out)       # before the work: a report that could not be written is found now
        splits, classes, n_layers, dim = load_splits(args, say)
        settings = expand_settings(args.settings.split(","), [c.strip() for c in args.combine.split(",") if c.strip()], n_layers)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        say("error: " + " ".join(str(e).split("\n")))
        return 2
    load_s = time.perf_counter() - t0
    print(f"loaded in {load_s:.1f} s: {n_layers} layers of width {dim}, {len(classes)} classes; settings {settings}",
          file=sys.stderr, flush=True)
    train, dev, test = splits["train"], splits.get("dev"), splits.get("test")
    stats = train.token_stats() if args.standardize else None
    runs = []
    for setting in settings:
        for k in range(args.seeds):
            cfg = ProbeConfig(task=args.task, classifier=args.classifier, epochs=args.epochs, batch_size=args.batch_size,
                              lr=args.lr, hidden=args.hidden, dropout=args.dropout, seed=args.seed + k, classes=classes,
                              stats=stats, optimizer=args.optimizer, l2=args.l2)
            r = train_setting(setting, cfg, train, dev, test, n_layers, dim, log)
            r["seed"] = cfg.seed
            runs.append(r)
            shown = {s: f"{100 * r[s]['accuracy']:.1f}" for s in ("dev", "test") if s in r}
            print(f"{setting} seed {cfg.seed}: acc {shown} (best {'iteration' if r['optimizer'] == 'lbfgs' else 'epoch'} {r['best_epoch']}, {r['seconds']:.1f} s)",
                  file=sys.stderr, flush=True)
    rows = summarize(runs)
    meta = {"task": args.task, "classifier": args.classifier if args.task == "sentence" else "linear",
            "classes": classes, "train": redact(args.train), "dev": redact(args.dev), "test": redact(args.test),
            "sizes": {k: {"sentences": len(s.records), "targets": int(len(s.targets))} for k, s in splits.items()},
            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "hidden": args.hidden,
            "dropout": args.dropout, "optimizer": args.optimizer, "l2": args.l2, "standardize": args.standardize, "seeds": list(range(args.seed, args.seed + args.seeds)),
            "threads": torch.get_num_threads(), "machine": f"{platform.machine()}, {platform.processor() or '?'}",
            "load_seconds": round(load_s, 2), "total_seconds": round(time.perf_counter() - t0, 2)}
    write_report(args.out, rows, runs, meta, majority_baseline(train, [dev, test]))
    with open(f"{args.out}/table.md") as f:
        print(f.read())
    say(f"probe: {len(settings)} settings x {args.seeds} seeds in {meta['total_seconds']:.1f} s -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elmo-pipeline probe", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
