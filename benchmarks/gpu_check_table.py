"""The GPU check's last stage: one table from what the other stages wrote to `--out` (see gpu_check.py). It imports
no torch, so it runs in a second even where the others failed.

    python benchmarks/gpu_check_table.py --out DIR     # writes DIR/table.md and prints it
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.tables import format_table


def _load(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {"error": "stage did not run (no JSON)"}


def _tests(out: Path) -> str:
    path = out / "test_gpu.xml"
    if not path.exists():
        return "did not run"
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    get = lambda k: int(suite.get(k, 0))  # noqa: E731
    passed = get("tests") - get("failures") - get("errors") - get("skipped")
    return f"{passed} passed, {get('failures')} failed, {get('errors')} errors, {get('skipped')} skipped"


def stage_table(out: Path) -> str:
    env, syncs, bench = _load(out, "env"), _load(out, "syncs"), _load(out, "bench")
    rows: list[list] = []
    info = env.get("env", {})
    rows.append(["env", "versions", f"torch {info.get('torch')}, transformers {info.get('transformers')}, "
                                    f"{env.get('cuda', {}).get('device', 'no CUDA')}"])
    missing = [k for k, v in env.get("packages", {}).items() if str(v).startswith("missing")]
    rows.append(["env", "missing packages", ", ".join(missing) or "none"])
    rows.append(["env", "default page size", env.get("engine_default_page_size")])
    for form, kernels in env.get("sdpa_kernels", {}).items():
        rows.append(["SDPA", form, ", ".join(k for k, v in kernels.items() if v == "ok") or "none"])
    rows.append(["tests", "tests/engine/worker/test_gpu.py", _tests(out)])
    for step, result in syncs.items():
        if isinstance(result, dict) and result.get("available"):
            sites = "; ".join(f"{site} x{n}" for site, n in result["sites"].items()) or "none"
            rows.append(["syncs", step, f"{result['total']}: {sites}"])
        else:
            rows.append(["syncs", step, result.get("reason", result) if isinstance(result, dict) else result])
    for system, result in bench.get("throughput", {}).items():
        rows.append(["throughput", system, f"{result['tok_s']} tok/s" if "tok_s" in result else result])
    for label, key in (("decode step", "decode_steps"), ("page size", "page_sizes")):
        for r in bench.get(key, []):
            rows.append([label, f"{r['rows']} rows, page {r['page_size']}",
                         f"{r['step_ms']} ms/step (schedule {r['schedule_ms']}, build {r['build_ms']}, forward "
                         f"{r['forward_ms']}, sample {r['sample_ms']})"])
    for name, stage in (("env", env), ("syncs", syncs), ("bench", bench)):
        if "error" in stage:
            rows.append([name, "stage error", stage["error"]])
    model = bench.get("model", {})
    title = f"GPU check: {model.get('shape', '?')}, {model.get('dtype', '?')} on {model.get('device', '?')}"
    return f"{title}\n\n{format_table(['stage', 'what', 'result'], rows, align='lll')}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the folder the other stages wrote to")
    args = p.parse_args(argv)
    table = stage_table(args.out)
    (args.out / "table.md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
