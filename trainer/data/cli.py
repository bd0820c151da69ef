"""``python -m trainer data prepare | curate | inspect``.

    python -m trainer data prepare --source pickapic --input DIR --task t2i --output raw.jsonl
    python -m trainer data curate --input raw.jsonl --out-dir processed/t2i --prefix pickapic_ \\
        --min-prompt-words 6 --eval-size 2048 --eval-subset-sizes 64 256 --no-check-media
    python -m trainer data inspect --train processed/t2i/pickapic_train.jsonl \\
        --eval processed/t2i/pickapic_eval256.jsonl --decode-media

Exit status: 0 on success, 1 when the data is bad (every problem is printed with its file and
line), 2 on a usage error (argparse).
"""
from __future__ import annotations

import argparse
import json
import sys

from trainer.data.curate import CurateError, curate
from trainer.data.inspect_data import expand_folders, inspect_files, report
from trainer.data.prepare import CONVERTERS, PrepareError, prepare
from trainer.data.schema import TASKS


FORMATS = ("Prompt files, as launch --prompt-data reads them: JSONL (one object a line with a "
           "string 'prompt', optional 'metadata'; other fields such as GenEval's tag / include "
           "/ exclude go into the metadata), parquet (the same fields as columns), .txt (one "
           "prompt a line), or a Flow-GRPO dataset folder (train.txt + test.txt, or "
           "train_metadata.jsonl + test_metadata.jsonl).")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer data",
                                     description="Prepare, curate and inspect prompt data. "
                                                 + FORMATS)
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare", help="convert a prompt source to the unified JSONL schema",
        description="Convert a prompt source to the unified JSONL schema "
                    "({prompt, metadata: {task, sample_id, ...}}). " + FORMATS)
    prep.add_argument("--source", required=True, choices=sorted(CONVERTERS),
                      help="pickapic: Pick-a-Pic parquet shards (their caption column); "
                           "prompts: any prompt file or folder of them (.jsonl, .parquet, .txt)")
    prep.add_argument("--input", required=True,
                      help="input file, folder of files, or a dataset folder (train + test "
                           "files: their split is kept)")
    prep.add_argument("--output", required=True,
                      help="output .jsonl; for a dataset folder input, a folder that gets "
                           "train.jsonl and test.jsonl")
    prep.add_argument("--task", default="t2i", choices=TASKS,
                      help="metadata.task of records that do not name one (default: t2i)")
    prep.add_argument("--id-prefix", default=None,
                      help="sample_id prefix (default: 'pickapic_' / the input's file stem + '_')")
    prep.add_argument("--prompt-column", default=None,
                      help="parquet column with the prompts (default: prompt, else caption)")

    cur = sub.add_parser(
        "curate", help="dedup, filter and split into train / eval files",
        description="De-duplicate, filter and split unified records (the output of prepare) "
                    "into <prefix>train.jsonl, <prefix>eval.jsonl and nested eval subsets. "
                    "The split is a hash of each sample_id, so reruns write identical files.")
    cur.add_argument("--input", required=True, nargs="+",
                     help="unified .jsonl / .parquet files (prepare's output)")
    cur.add_argument("--out-dir", required=True, help="folder the split files are written to")
    cur.add_argument("--prefix", default="", help="output file prefix, e.g. pickapic_")
    cur.add_argument("--min-prompt-words", type=int, default=0,
                     help="drop prompts with fewer whitespace-separated words (default: 0, "
                          "keep all)")
    cur.add_argument("--eval-size", type=int, default=None,
                     help="exact number of eval records (smallest sample_id hashes)")
    cur.add_argument("--eval-fraction", type=float, default=None,
                     help="share of records in eval when --eval-size is not given (default 0.01)")
    cur.add_argument("--eval-subset-sizes", type=int, nargs="*", default=[],
                     help="also write nested eval subsets <prefix>eval<K>.jsonl")
    cur.add_argument("--no-check-media", action="store_true",
                     help="keep records whose media files are missing, or whose reference images "
                          "do not decode")
    cur.add_argument("--split-salt", default="", help="change it to draw a different split")

    ins = sub.add_parser(
        "inspect", help="check prompt files; non-zero exit on any error",
        description="Check prompt files with the trainer's own reader and report every "
                    "problem as file:line: [class] message; exit 1 on any. " + FORMATS)
    ins.add_argument("--train", default=None,
                     help="training prompt file, or a dataset folder (its test file is then "
                          "checked as eval, and for leaks)")
    ins.add_argument("--eval", action="append", default=[],
                     help="eval prompt file (repeatable); checked for prompts or sample_ids "
                          "that are also in --train")
    ins.add_argument("--decode-media", action="store_true",
                     help="also decode every referenced media file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "prepare":
        try:
            stats = prepare(source=args.source, input_path=args.input, output=args.output,
                            task=args.task, id_prefix=args.id_prefix,
                            prompt_column=args.prompt_column)
        except PrepareError as exc:
            print(f"prepare: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {stats['written']} records to {args.output} "
              f"({stats['skipped_empty']} empty prompts skipped)")
        return 0
    if args.command == "curate":
        try:
            result = curate(inputs=args.input, out_dir=args.out_dir, prefix=args.prefix,
                            min_prompt_words=args.min_prompt_words, eval_size=args.eval_size,
                            eval_fraction=args.eval_fraction,
                            eval_subset_sizes=args.eval_subset_sizes,
                            check_media=not args.no_check_media, split_salt=args.split_salt)
        except CurateError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        print(json.dumps(result, indent=2))
        return 0
    if args.train is None and not args.eval:
        print("inspect: give --train and/or --eval", file=sys.stderr)
        return 2
    train, evals = expand_folders(args.train, args.eval)
    findings, stats = inspect_files(train=train, evals=evals, decode_media=args.decode_media)
    files = ([train] if train else []) + evals
    print(report(findings, stats, files), file=sys.stderr if findings else sys.stdout)
    return 1 if findings else 0
