"""The documentation: the README stays short, the generated reference pages are what the code
declares, every repository file the docs name exists, the MkDocs site builds in strict mode (a
broken link or anchor fails it) and loads no fonts from other servers, and git ignores the keys,
certificates and data the docs have a user make in the project folder."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from fedcluster_flwr.cli import docs_reference

DOCS = ROOT / "docs"
README_MAX_LINES = 250


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", sorted(docs_reference.PAGES), ids=lambda p: p.name)
def test_reference_page_is_generated_from_the_code(page):
    expected = docs_reference.PAGES[page]()
    assert page.is_file() and page.read_text() == expected, (
        f"{page.relative_to(ROOT)} is stale: run python -m fedcluster_flwr.cli.docs_reference"
    )


def test_every_config_key_is_in_the_reference():
    from fedcluster_flwr.config.load import config_to_dict, load_config

    page = docs_reference.CONFIG_PAGE.read_text()
    from fedcluster_flwr.declarations.schema import ConfigError

    for conf in sorted((ROOT / "conf").glob("*.yaml")):
        try:
            config, _ = load_config(conf)
        except ConfigError:  # a conf that needs files this machine lacks (pretrained weights)
            continue
        for section, values in config_to_dict(config).items():
            keys = [f"{section}.{key}" for key in values] if isinstance(values, dict) else [section]
            for key in keys:
                assert f"`{key}`" in page, f"{key} (used by {conf.name}) is missing from the reference"


# A path of the repository named in code text (`benchmarks/flhc/README.md`): links to files outside
# docs/ would break the site, so the docs name them; this checks that each still exists.
REPO_PATH = re.compile(r"(?<![\w/.~])((?:benchmarks|conf|tests|fedcluster_flwr|deploy|docs)/[\w./-]*\w\.(?:md|py|yaml|yml|sh|json|png))")


def named_paths(text: str) -> set[str]:
    # The bad-input table (tests/test_bad_input.py) names missing files on purpose.
    text = re.sub(r"<!-- bad-input table.*?<!-- end of the bad-input table -->", "", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", text)
    return {path for span in spans for path in REPO_PATH.findall(span)}


def test_every_repository_file_the_docs_name_exists():
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    missing = {
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages
        for path in named_paths(page.read_text())
        if not (ROOT / path).exists()
    }
    assert not missing, sorted(missing)


def test_the_readmes_links_lead_to_files():
    """The README is read on the repository's page, not built by MkDocs: its relative links must
    lead to files (into docs/, benchmarks/)."""
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_the_docs_site_builds_in_strict_mode(tmp_path):
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]'; the test extra has it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    # The site serves its fonts itself (mkdocs.yml: font: false): a reader's browser asks no other server.
    pages = [page.read_text() for page in (tmp_path / "site").rglob("*.html")]
    assert pages and not [page for page in pages if "fonts.googleapis.com" in page or "fonts.gstatic.com" in page]


# What docs/how-to/deploy.md and the README have a user make in the project folder: private keys,
# certificates, exported data, the built site. None may be committed by accident.
MADE_BY_THE_DOCS = ("certs/ca.key", "certs/server.key", "certs/ca.crt", "certs/server.pem", "keys/node0",
                    "keys/node0.pub", "exported/client_0/data.npz", "exported/manifest.json", "deploy/certs/ca.key",
                    "deploy/keys/node0", "deploy/data/client_0/data.npz", "site/index.html")


def test_git_ignores_every_key_certificate_and_build_folder_the_docs_make():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    deploy = (DOCS / "how-to" / "deploy.md").read_text()
    assert "make_certificates.sh certs " in deploy and "-f keys/node0" in deploy and " exported --set" in deploy
    done = subprocess.run(["git", "check-ignore", "--no-index", *MADE_BY_THE_DOCS], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    ignored = set(done.stdout.split())
    assert ignored == set(MADE_BY_THE_DOCS), f"not git-ignored: {sorted(set(MADE_BY_THE_DOCS) - ignored)}"
