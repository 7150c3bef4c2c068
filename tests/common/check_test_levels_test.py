"""check_test_levels.py on hand-written `bazel query --output=xml` text: the
labels it reports are exactly those with no level tag or two."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_test_levels  # noqa: E402

QUERY_XML = """<?xml version="1.1" encoding="UTF-8" standalone="no"?>
<query version="2">
  <rule class="cc_test" location="x" name="//tests/a:one_level">
    <string name="name" value="one_level"/>
    <list name="tags"><string value="unit"/><string value="exclusive"/></list>
  </rule>
  <rule class="py_test" location="x" name="//tests/a:no_tags">
    <string name="name" value="no_tags"/>
  </rule>
  <rule class="py_test" location="x" name="//tests/a:other_tags_only">
    <list name="tags"><string value="exclusive"/><string value="manual"/></list>
  </rule>
  <rule class="cc_test" location="x" name="//tests/a:two_levels">
    <list name="tags"><string value="gpu"/><string value="integration"/></list>
  </rule>
  <rule class="cc_library" location="x" name="//tests/a:lib">
    <list name="tags"/>
  </rule>
</query>
"""


class CheckTestLevelsTest(unittest.TestCase):
    def test_reads_tags_of_test_rules_only(self):
        tags = check_test_levels.test_tags(QUERY_XML)
        self.assertEqual(tags, {
            "//tests/a:one_level": ["unit", "exclusive"],
            "//tests/a:no_tags": [],
            "//tests/a:other_tags_only": ["exclusive", "manual"],
            "//tests/a:two_levels": ["gpu", "integration"],
        })

    def test_reports_targets_without_exactly_one_level(self):
        lines = check_test_levels.offenders(check_test_levels.test_tags(QUERY_XML))
        self.assertEqual(lines, [
            "//tests/a:no_tags: level tags none",
            "//tests/a:other_tags_only: level tags none",
            "//tests/a:two_levels: level tags gpu, integration",
        ])

    def test_every_level_alone_passes(self):
        for level in check_test_levels.LEVELS:
            self.assertEqual(check_test_levels.offenders({"//t:x": [level, "manual"]}), [])


if __name__ == "__main__":
    unittest.main()
