"""Reads pytest's JUnit XML (`--junitxml`) for scripts/test.sh: prints `passed failed skipped`
on the first line, then `skip\t<test id>\t<reason>` per skipped test and `fail\t<test id>` per
failed one."""

import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
passed = failed = skipped = 0
skips = []
fails = []
for suite in suites:
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            fails.append(f"fail\t{name}")
        elif (s := case.find("skipped")) is not None:
            skipped += 1
            reason = (s.get("message") or "").replace("\t", " ").replace("\n", " ")
            skips.append(f"skip\t{name}\t{reason}")
        else:
            passed += 1
print(passed, failed, skipped)
for line in skips + fails:
    print(line)
