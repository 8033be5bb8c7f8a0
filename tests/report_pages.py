"""Reading a report's HTML page in tests: the files it names and the text it shows."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path


class Links(HTMLParser):
    """Every file an HTML page names (img src, a href), with the sizes its images declare."""

    def __init__(self):
        super().__init__()
        self.images: list[dict] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        elif tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])

    def handle_data(self, data):
        self.text.append(data)


def parse(page: Path) -> Links:
    """The files and text of the HTML page at ``page``."""
    links = Links()
    links.feed(page.read_text())
    return links
