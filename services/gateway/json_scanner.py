"""Complete JSON objects and arrays at one nesting level of a growing text, found as the text
arrives (the tool-call parser's constrained modes stream calls out as their JSON closes)."""

from __future__ import annotations


class JsonScanner:
    """Finds the complete JSON objects/arrays at one nesting ``level`` of a growing text
    (0: the top value itself; 1: the elements of a top-level array)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.pos = 0  # next character to scan
        self.depth = 0
        self.in_string = self.escaped = self.dead = False
        self.start: int | None = None

    def feed(self, text: str, opener: str) -> list[tuple[int, int]]:
        found = []
        while self.pos < len(text) and not self.dead:
            char, pos = text[self.pos], self.pos
            self.pos += 1
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else \
                    (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "[{":
                if self.depth == 0 and char != opener:
                    self.dead = True  # not the shape we constrained: all content at finish
                    break
                if self.depth == self.level:
                    self.start = pos
                self.depth += 1
            elif char in "]}":
                self.depth -= 1
                if self.depth == self.level and self.start is not None:
                    found.append((self.start, pos + 1))
                    self.start = None
                if self.depth <= 0:
                    self.dead = True  # the top value is complete
            elif self.depth == 0 and not char.isspace():
                self.dead = True
        return found
