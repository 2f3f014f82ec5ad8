"""`meshtrain data prepare` against bare `tokenizers`: MB/s per worker, scaling over workers, and peak
memory against the input's size.

Input: JSON lines made of this Python's standard-library sources, copied (each copy's documents
marked, so no two are equal) up to each size. The tokenizer is a byte-level BPE of 8,192 tokens
trained once on the corpus, passed with --tokenizer, so every run tokenizes the same way.

Baseline: `Tokenizer.encode_batch` on the same text (the smaller input), already in memory, one thread
(TOKENIZERS_PARALLELISM=false, the speed of one core), in this process, batches of 1 MiB of text:
what a worker would do with no reading, JSON, hashing or writing. Throughput and scaling over
workers are measured on the larger input, memory on both. Each `prepare` runs as the CLI in a
subprocess; its time includes start-up (about 2 s), its memory is the peak of the sum of its processes'
resident sets (sampled every 20 ms), and its own ru_maxrss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import markdown, write_results

MB = 1 << 20


def corpus_jsonl(path: Path, size: int) -> None:
    from meshtrain.data import stdlib_sources

    texts = [p.read_text(errors="replace") for p in stdlib_sources()]
    written, copy = 0, 0
    with path.open("w") as f:
        while written < size:
            for text in texts:
                written += f.write(json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n")
                if written >= size:
                    break
            copy += 1


def tree_rss_mb(pid: int) -> float:
    """The resident memory of a process and its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = {pid}, [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(frontier)
    total = 0
    for p in tree:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total / MB


def run_prepare(inp: Path, out: Path, tokenizer: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "meshtrain", "data", "prepare", "--input", str(inp), "--out", str(out)]
    cmd += ["--tokenizer", str(tokenizer), "--workers", str(workers)]
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", probe, *cmd], stdout=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    stdout, _ = proc.communicate()
    sampler.join()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return {
        "input_mb": inp.stat().st_size / MB,
        "workers": workers,
        "seconds": seconds,
        "mb_per_s": inp.stat().st_size / MB / seconds,
        "peak_tree_rss_mb": peak[0],
        "peak_process_rss_mb": int(stdout.split()[-1]) / 1024,
    }


def bare_encode_batch(inp: Path, tokenizer: Path) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    texts = [json.loads(line)["text"] for line in inp.open()]
    start = time.perf_counter()
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= MB:
            tok.encode_batch(batch, add_special_tokens=False)
            batch, chars = [], 0
    tok.encode_batch(batch, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return {"input_mb": inp.stat().st_size / MB, "seconds": seconds, "mb_per_s": inp.stat().st_size / MB / seconds}


def main(a) -> None:
    from meshtrain.data import prepare, stdlib_sources

    small_mb, large_mb = a.data_sizes
    with tempfile.TemporaryDirectory(dir=a.data_tmp or None) as tmp:
        tmp = Path(tmp)
        prepare(stdlib_sources(), tmp / "tok", vocab_size=8192, val_fraction=0, progress=False)
        tokenizer = tmp / "tok" / "tokenizer.json"
        small, large = tmp / "small.jsonl", tmp / "large.jsonl"
        corpus_jsonl(small, small_mb * MB)
        corpus_jsonl(large, large_mb * MB)
        rows = [
            {"what": "bare encode_batch, 1 thread", **bare_encode_batch(small, tokenizer)},
            *(
                {"what": f"prepare --workers {w}", **run_prepare(large, tmp / f"out{w}", tokenizer, w)}
                for w in range(1, a.data_workers + 1)
            ),
            {
                "what": f"prepare --workers {a.data_workers}",
                **run_prepare(small, tmp / "small", tokenizer, a.data_workers),
            },
        ]
        same = all(
            (tmp / "out1" / f.name).read_bytes() == f.read_bytes() for f in (tmp / f"out{a.data_workers}").iterdir()
        )
    base, one = rows[0]["mb_per_s"], rows[1]["mb_per_s"]
    table = markdown(
        ["run", "input MB", "workers", "s", "MB/s", "x bare (per worker)", "x 1 worker", "peak RSS MB (tree)"],
        [
            [
                r["what"],
                f"{r['input_mb']:.0f}",
                str(r.get("workers", 1)),
                f"{r['seconds']:.1f}",
                f"{r['mb_per_s']:.2f}",
                f"{r['mb_per_s'] / r.get('workers', 1) / base:.2f}",
                f"{r['mb_per_s'] / one:.2f}" if "workers" in r and r["input_mb"] == rows[1]["input_mb"] else "",
                f"{r['peak_tree_rss_mb']:.0f} (process {r['peak_process_rss_mb']:.0f})" if "workers" in r else "",
            ]
            for r in rows
        ],
    )
    w = a.data_workers
    summary = (
        f"\n\nPeak memory at {large_mb} MB = {rows[w]['peak_tree_rss_mb'] / rows[-1]['peak_tree_rss_mb']:.2f}x "
        f"its peak at {small_mb} MB (workers {w}); output of {w} workers byte-identical to 1 worker's: {same}."
    )
    write_results("data", rows, table + summary)
