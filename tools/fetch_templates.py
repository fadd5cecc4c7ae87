"""Fetches the released chat templates that llama.cpp tests its own chat handling with, for
tests/test_released_templates.py: the ``models/templates/*.jinja`` files of llama.cpp as vendored in
llama-cpp-python's source release on PyPI (gpt-oss, Llama 3.x, Qwen 2.5/3, Mistral, Phi, Gemma, DeepSeek and
others, as their model repositories ship them).

Only the templates are kept, beside the tests' other cached files (``tests/.cache/templates/llama.cpp-<version>``,
ignored by git); the 77 MB archive is read from PyPI's simple index (``PIP_INDEX_URL`` where set), checked against
its pinned SHA-256, and dropped. Run by ``make templates`` (part of ``make test``); a second run finds them and does
nothing.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
ARCHIVE = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER = re.compile(r"^[^/]+/vendor/llama\.cpp/models/templates/([\w.+-]+\.jinja)$")
DONE = ".complete"


def templates_dir() -> Path:
    """Where the templates lie once fetched (tests/test_released_templates.py looks here)."""
    return Path(__file__).resolve().parent.parent / "tests" / ".cache" / "templates" / f"llama.cpp-{VERSION}"


def archive_url() -> str:
    """The source archive's address, read off the package's page of the simple index."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/{PACKAGE}/"
    with urllib.request.urlopen(page_url, timeout=60) as response:
        page = response.read().decode("utf-8", "replace")
    for href in re.findall(r'href="([^"]+)"', page):
        if urllib.parse.urlsplit(href).path.endswith("/" + ARCHIVE):
            return urllib.parse.urljoin(page_url, href.split("#")[0])
    raise SystemExit(f"{ARCHIVE} is not listed on {page_url}")


def fetch() -> Path:
    target = templates_dir()
    if (target / DONE).exists():
        return target
    url = archive_url()
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{url}: SHA-256 {digest}, expected {SHA256}")
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive.getmembers():
            found = MEMBER.match(member.name)
            if found and member.isfile():
                (target / found.group(1)).write_bytes(archive.extractfile(member).read())
                count += 1
    if count == 0:
        raise SystemExit(f"{ARCHIVE} holds no models/templates/*.jinja")
    (target / DONE).write_text(f"{count} templates from {ARCHIVE}\n")
    return target


if __name__ == "__main__":
    where = fetch()
    print(f"{len(list(where.glob('*.jinja')))} released chat templates in {where}")
