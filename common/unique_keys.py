"""Mappings read from JSON or YAML text refusing a key written twice in one of them: json.loads and
yaml.safe_load keep the last value silently, so one of the two settings would be dropped without a word."""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A key written twice in one mapping; the message names it (and, in YAML, its line and column)."""


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """json.loads' object_pairs_hook."""
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(f"duplicate key {key!r}")
        result[key] = value
    return result


MAX_YAML_DEPTH = 64  # a settings file is a few levels deep


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a key written twice in one mapping, and nesting deeper than MAX_YAML_DEPTH;
    `check_mapping_key` lets a subclass refuse other keys."""

    _depth = 0

    def compose_node(self, parent, index):
        # The composer recurses once per level: 10,000 '[' reached Python's recursion limit, a RecursionError
        # (a traceback) where every other malformed file is a YAMLError its reader words in one line.
        if self._depth >= MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {MAX_YAML_DEPTH} levels (line {mark.line + 1}, column {mark.column + 1})",
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def check_mapping_key(self, key_node: yaml.Node, key: object) -> None:
        """Called with every key of every mapping (merges aside) before it is checked for a repeat. Not `check_key`:
        that is the scanner's test for a '?' key indicator, and overriding it broke every '?' starting a token."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        merged = False
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges may override: YAML's own rule
                if merged:  # but '<<' twice is a key written twice: PyYAML kept the first merge's values
                    mark = key_node.start_mark
                    raise DuplicateKeyError(f"duplicate key '<<' (line {mark.line + 1}, column {mark.column + 1})")
                merged = True
                continue
            key = self.construct_object(key_node, deep=deep)
            self.check_mapping_key(key_node, key)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: SafeLoader names it below
                continue
            if duplicate:
                mark = key_node.start_mark
                raise DuplicateKeyError(f"duplicate key {key!r} (line {mark.line + 1}, column {mark.column + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)
