"""Reads pytest's JUnit XML (`--junitxml`) for scripts/test.sh: prints `passed failed skipped`
on the first line, then one `<test id>\t<reason>` line per skipped test."""

import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
passed = failed = skipped = 0
skips = []
for suite in suites:
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif (s := case.find("skipped")) is not None:
            skipped += 1
            reason = (s.get("message") or "").replace("\t", " ").replace("\n", " ")
            skips.append(f"{name}\t{reason}")
        else:
            passed += 1
print(passed, failed, skipped)
for line in skips:
    print(line)
