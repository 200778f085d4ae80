#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sum meson test logs (meson-logs/testlog.json, one JSON object per line) into the closing
line 'N passed, N failed[, N skipped]'. Exit status 1 when anything failed or nothing ran."""
import json
import sys

passed = failed = skipped = 0
failures = []
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                t = json.loads(line)
                r = t.get("result", "")
                if r in ("OK", "EXPECTEDFAIL"):
                    passed += 1
                elif r == "SKIP":
                    skipped += 1
                else:
                    failed += 1
                    failures.append(f"{path}: {t.get('name')} {r}")
    except FileNotFoundError:
        failed += 1
        failures.append(f"{path}: missing (the suite did not run)")
for f in failures:
    print("FAILED:", f)
line = f"{passed} passed, {failed} failed"
if skipped:
    line += f", {skipped} skipped"
print(line)
sys.exit(1 if failed or passed == 0 else 0)
