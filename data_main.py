"""Tokenize a corpus once, into a token store that any run reads as its `data.source`.

    python data_main.py --source=PATH|DIR|GLOB --tokenizer=T --out=DIR [--num_workers=N] \
        [--format=text|chat|prompt_completion] [--text_field=text] [--shard_bytes=N] [--overwrite]

--source: .txt (a document per paragraph), .jsonl (an object per line, the text in
--text_field), .parquet (a row each), a directory or a glob of them, as data.source reads them.
--tokenizer: what data.tokenizer accepts ('byte', a tokenizer.json or its directory, a
SentencePiece .model); chat needs the checkpoint's tokenizer directory (its chat template).
The work is split into pieces of about --shard_bytes (byte ranges cut at line or paragraph
boundaries, Parquet row-group ranges), one shard each, tokenized by --num_workers processes
(default: this machine's cores) in bounded memory, with a progress line on stderr
(documents, tokens, MB/s, ETA) and each worker's tokens/s at the end.

OUT gets index.json last (nnx_zoo/data/token_store.py has the format): killed, a second run with
the same arguments continues from the finished shards. A non-empty --out that is neither an
unfinished run of these arguments nor empty is refused (exit 2); --overwrite replaces an
earlier store or unfinished run there. The library code is nnx_zoo/data/tokenize_corpus.py.
"""

from __future__ import annotations

import os

from nnx_zoo.launch import cli

# Workers are spawned and import this module again: no huge-page re-exec, no XLA flags.
cli.preamble(huge_pages=False, cpu_flags=False, cpu_only=True)

FLAGS = cli.new_flags()

DATA = cli.define_flags(
    FLAGS,
    ("source", str, None, ".txt / .jsonl / .parquet file, a directory or a glob of them."),
    ("tokenizer", str, "byte", "'byte', a tokenizer.json (or its directory) or a .model."),
    ("out", str, None, "Directory of the store: new, empty, or an unfinished run to continue."),
    ("num_workers", int, None, "Tokenizing processes; default: the machine's cores."),
    (
        "format",
        ("text", "chat", "prompt_completion"),
        "text",
        "text: documents | chat: `messages` records | prompt_completion: prompt/completion.",
    ),
    ("text_field", str, "text", "The JSONL field / Parquet column holding the text."),
    ("shard_bytes", int, 128 * 2**20, "Input bytes per piece (one shard each)."),
    ("overwrite", bool, False, "Replace an earlier store or unfinished run at --out."),
)


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    for flag in (DATA.source, DATA.out):
        if not flag.value:
            cli.usage_error(f"--{flag.name} is required (--source=PATH --out=DIR)")
    from nnx_zoo.data.tokenize_corpus import Request, tokenize_corpus

    workers = DATA.num_workers.value
    request = Request(
        source=DATA.source.value,
        tokenizer=DATA.tokenizer.value,
        out=os.path.expanduser(DATA.out.value),
        num_workers=(os.cpu_count() or 1) if workers is None else workers,
        data_format=DATA.format.value,
        text_field=DATA.text_field.value,
        overwrite=DATA.overwrite.value,
        shard_bytes=DATA.shard_bytes.value,
    )
    try:
        index = tokenize_corpus(request)
    except OSError as e:  # --out cannot be written (permissions, a full disk)
        cli.usage_error(f"--out={DATA.out.value}: cannot write the store ({e.strerror or e})")
    print(
        f"wrote {index['documents']:,} documents, {index['tokens']:,} tokens in "
        f"{len(index['shards'])} shards to {request.out}",
        flush=True,
    )


def run(argv: list[str] | None = None) -> None:
    """The `zoo-data` console script: the same as `python data_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
