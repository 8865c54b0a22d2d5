"""A YAML file a user gives (`--config FILE`, a data mixture file) read without trusting it: every
refusal is one UserError line naming the file.

- Size: at most MAX_BYTES (a config is a few KB; a 30 MB value would take PyYAML minutes, the
  largest accepted file at most seconds).
- Text: UTF-8 (a binary file names the first byte that is not).
- Aliases: at most MAX_ALIASES uses of `*anchor`, and the document at most MAX_NODES nodes once
  every alias is expanded, no alias inside itself. PyYAML shares an alias's object rather than
  copying it, so a "billion laughs" file of a few lines loads in microseconds, but everything that
  walks the result afterwards (a message's repr, json.dumps of the config) expands it: gigabytes.
- Keys: a key given twice in one mapping (`train:` twice, or `lr:` twice in one section), at any
  depth, names the key and both lines; PyYAML would keep the last one and drop the first silently.
"""

from __future__ import annotations

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from errors import UserError

MAX_BYTES = 256 << 10  # its slowest content (a flow list of small ints) loads in ~2.5 s
MAX_ALIASES = 100
MAX_NODES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *defaults`: merged keys may be overridden
# PyYAML's own parser: libyaml's (CSafeLoader) crashes the process on deeply nested input, where
# this one raises RecursionError
Loader = yaml.SafeLoader


def load(path: str, flag: str):
    """The document in `path` (None for an empty file), or UserError `FLAG: 'PATH' ...`."""
    text = _text(path, flag)
    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _Walk(loader, f"{flag}: '{path}'").check(node)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise UserError(f"{flag}: '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise UserError(
            f"{flag}: '{path}' nests lists or mappings deeper than can be read; a config is a"
            f" mapping of sections"
        ) from None
    finally:
        loader.dispose()


def _text(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # a size from stat() would lie for a pipe or /dev/zero
    except OSError as e:
        raise UserError(f"{flag}: cannot read '{path}': {e.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise UserError(
            f"{flag}: '{path}' is larger than {MAX_BYTES} bytes (256 KiB), the most accepted; a"
            f" config or mixture file is a few KB of YAML text"
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{flag}: '{path}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start});"
            f" a config or mixture file is YAML text"
        ) from None


class _Walk:
    """One pass over the composed node graph (aliases are shared nodes in it): counts the alias
    uses and the expanded size, refuses an alias inside itself and a key given twice."""

    def __init__(self, loader, where: str):
        self.loader, self.where = loader, where
        self.aliases = 0
        self.size: dict[int, int] = {}  # id(node) -> nodes once its aliases are expanded
        self.open: set[int] = set()  # nodes being walked: meeting one again is a cycle

    def check(self, root: Node) -> None:
        total = self.walk(root, "")
        if total > MAX_NODES:
            raise UserError(
                f"{self.where}: its aliases expand to {total} nodes, more than the {MAX_NODES}"
                f" accepted (an alias bomb?); write the values out"
            )

    def walk(self, node: Node, path: str) -> int:
        key = id(node)
        if key in self.open:
            raise UserError(
                f"{self.where}: line {node.start_mark.line + 1}: an alias refers to a node that"
                f" contains it (a recursive structure); write the values out"
            )
        if key in self.size:  # a second reference: an alias use
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise UserError(
                    f"{self.where}: more than {MAX_ALIASES} alias uses (*name), line"
                    f" {node.start_mark.line + 1} (an alias bomb?); write the values out"
                )
            return self.size[key]
        self.open.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            for i, child in enumerate(node.value):
                total += self.walk(child, f"{path}[{i}]")
        elif isinstance(node, MappingNode):
            self.unique_keys(node, path)
            for k, v in node.value:
                name = k.value if isinstance(k, ScalarNode) else "?"
                total += self.walk(k, path) + self.walk(v, f"{path}.{name}" if path else name)
        self.open.discard(key)
        self.size[key] = total
        if total > MAX_NODES:  # stop before a bomb's arithmetic grows any further
            self.check(node)
        return total

    def unique_keys(self, node: MappingNode, path: str) -> None:
        first_line: dict[object, int] = {}  # key -> the line it was first given on
        for k, _ in node.value:
            if not isinstance(k, ScalarNode) or k.tag == MERGE_TAG:
                continue  # a complex key is PyYAML's error (unhashable); merges may be overridden
            value = self.loader.construct_object(k)  # `lr`, "lr" and 'lr' are one key
            line = k.start_mark.line + 1
            if value in first_line:
                where = f" in '{path}'" if path else ""
                raise UserError(
                    f"{self.where}: key '{k.value}'{where} is given twice (lines"
                    f" {first_line[value]} and {line}); YAML would keep only the second: merge"
                    f" them into one"
                )
            first_line[value] = line
