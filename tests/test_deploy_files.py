"""The deployment files in deploy/: the certificate and registration scripts' output and errors,
and the compose file checked against the commands of docs/how-to/deploy.md. Fast: no SuperLink is started (the
slow tests in test_deployment.py run the scripts against real ones). Docker's engine is not needed:
the compose file is checked by `docker compose config` where the compose plugin is installed, else
as YAML."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DEPLOY = ROOT / "deploy"
MAKE_CERTIFICATES = DEPLOY / "make_certificates.sh"
REGISTER_SUPERNODES = DEPLOY / "register_supernodes.sh"
ENV = dict(os.environ) | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def script(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(path), *args], capture_output=True, text=True, timeout=60, env=ENV)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


@needs_openssl
def test_certificate_names_the_given_hosts_and_localhost_and_is_signed_by_the_ca(tmp_path):
    out = tmp_path / "certs"
    done = script(MAKE_CERTIFICATES, str(out), "superlink.example.org", "10.0.0.5", "fd00::5", "127.0.0.1")
    assert done.returncode == 0, done.stderr
    san = subprocess.run(["openssl", "x509", "-in", str(out / "server.pem"), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    names = sorted(re.findall(r"(?:DNS|IP Address):[^,\s]+", san))
    assert names == sorted(["DNS:localhost", "IP Address:127.0.0.1", "DNS:superlink.example.org",
                            "IP Address:10.0.0.5", "IP Address:FD00:0:0:0:0:0:0:5"])  # 127.0.0.1 once
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "server.pem")],
                              capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert sorted(path.name for path in out.iterdir()) == ["ca.crt", "ca.key", "server.key", "server.pem"]
    assert {oct((out / key).stat().st_mode & 0o777) for key in ("ca.key", "server.key")} == {"0o600"}


@needs_openssl
def test_a_host_name_longer_than_a_certificate_cn_is_still_named(tmp_path):
    # a DNS label may have 63 characters and a name 253; openssl refuses a CN over 64, which the
    # first host once became (leaving a CA key behind that blocked every later try)
    host = "a" * 60 + ".example.org"
    done = script(MAKE_CERTIFICATES, str(tmp_path / "certs"), host)
    assert done.returncode == 0, done.stderr
    san = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "certs" / "server.pem"), "-noout", "-ext",
                          "subjectAltName"], capture_output=True, text=True, check=True).stdout
    assert f"DNS:{host}" in san


@needs_openssl
def test_certificate_script_refuses_to_overwrite_a_ca(tmp_path):
    assert script(MAKE_CERTIFICATES, str(tmp_path), "10.0.0.5").returncode == 0
    before = (tmp_path / "ca.crt").read_bytes()
    error = one_line_error(script(MAKE_CERTIFICATES, str(tmp_path), "10.0.0.6"))
    assert "ca.key exists; not overwriting it" in error
    assert (tmp_path / "ca.crt").read_bytes() == before


@pytest.mark.parametrize("args, names", [
    ((), "no OUTDIR and no HOST"),
    (("{tmp}/certs",), "no HOST given"),
    (("{tmp}/certs", "10.0.0.256"), "'10.0.0.256' is not an IPv4 address"),
    (("{tmp}/certs", "superlink.example.org:8000"), "has a port"),
    (("{tmp}/certs", "https://superlink.example.org"), "is a URL"),
    (("{tmp}/certs", "[fd00::5]:8000"), "without brackets or port"),
    (("{tmp}/certs", "super_link"), "'super_link' is neither an IPv4/IPv6 address nor a DNS name"),
    (("{tmp}/certs", "10.0.0.5", "-bad"), "'-bad' is neither"),
])
def test_certificate_script_names_a_bad_argument_in_one_line_and_writes_nothing(tmp_path, args, names):
    error = one_line_error(script(MAKE_CERTIFICATES, *(arg.format(tmp=tmp_path) for arg in args)))
    assert names in error
    assert not (tmp_path / "certs").exists()


def test_registration_script_names_a_bad_argument_in_one_line(tmp_path):
    private, ed25519 = tmp_path / "node0", tmp_path / "ed25519"
    private.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (tmp_path / "ed25519.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI example\n")
    for args, names in [
        (("compose",), "give a connection name and at least one public key"),
        (("compose", str(tmp_path / "missing.pub")), "missing.pub' does not exist"),
        (("compose", str(private)), "is not a public key (.pub)"),
        (("compose", f"{ed25519}.pub"), "is not an ECDSA (NIST curve) public key"),
    ]:
        assert names in one_line_error(script(REGISTER_SUPERNODES, *args)), args


# --- deploy/compose.yaml against the docs' deployment page --------------------------------------

DEPLOY_PAGE = ROOT / "docs" / "how-to" / "deploy.md"  # the docs' "Deployment on real devices"


def docs_command(program: str) -> list[str]:
    """The first command of the docs' "Deployment on real devices" page that starts with `program`,
    backslash continuations joined."""
    section = DEPLOY_PAGE.read_text()
    match = re.search(rf"^{program} (?:.*\\\n)*.*$", section, re.MULTILINE)
    assert match, f"the docs' deployment page ({DEPLOY_PAGE.relative_to(ROOT)}) has no {program} command"
    return shlex.split(match.group(0).replace("\\\n", " "))


def flags(command: list[str]) -> dict[str, str | None]:
    """--flag -> its value (None for a switch)."""
    found = {}
    for i, token in enumerate(command):
        if token.startswith("--"):
            following = command[i + 1] if i + 1 < len(command) else "--"
            found[token] = None if following.startswith("--") else following
    return found


def compose_model() -> tuple[dict, str]:
    """The compose file as docker compose resolves it when the plugin is installed, else as YAML."""
    compose = DEPLOY / "compose.yaml"
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        done = subprocess.run([docker, "compose", "-f", str(compose), "config", "--format", "json"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"docker compose config: {done.stderr}"
        return json.loads(done.stdout), "docker compose config"
    return yaml.safe_load(compose.read_text()), "yaml"


def mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (relative to deploy/ as written, or absolute as docker resolves it)."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):  # docker compose config's long form
            found[volume["target"]] = volume["source"]
        else:
            source, target = volume.split(":")[:2]
            found[target] = source
    return found


def host_path(source: str) -> Path:
    return (DEPLOY / source).resolve() if not os.path.isabs(source) else Path(source)


def command_of(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(token) for token in command]


def test_compose_file_deploys_the_docs_superlink_and_one_data_folder_per_supernode():
    model, checked_by = compose_model()
    services = model["services"]
    supernodes = sorted(name for name in services if name.startswith("supernode"))
    assert "superlink" in services and "register" in services and len(supernodes) >= 2, (checked_by, list(services))

    # The SuperLink: the docs' command (same flags: TLS, authentication, --host 0.0.0.0).
    superlink = services["superlink"]
    superlink_flags = flags(command_of(superlink))
    docs_superlink = flags(docs_command("flower-superlink"))
    assert set(superlink_flags) == set(docs_superlink), (superlink_flags, docs_superlink)
    assert superlink_flags["--host"] == docs_superlink["--host"] == "0.0.0.0"
    assert "--insecure" not in superlink_flags and "--enable-supernode-auth" in superlink_flags
    port = superlink_flags["--port"]
    superlink_mounts = mounts(superlink)
    for flag, file in (("--ssl-ca-certfile", "ca.crt"), ("--ssl-certfile", "server.pem"), ("--ssl-keyfile", "server.key")):
        source = superlink_mounts.get(superlink_flags[flag])
        assert source is not None and host_path(source) == (DEPLOY / "certs" / file).resolve(), (flag, source)
    published = superlink.get("ports", [])
    assert any(str(entry.get("target") if isinstance(entry, dict) else entry).endswith(port) for entry in published)

    # Every SuperNode: the docs' flags, dialling the service by name at the SuperLink's port,
    # with the CA, its own private key and its own data folder mounted, after the registration.
    docs_supernode = flags(docs_command("flower-supernode"))
    data_folders, keys, client_ids = set(), set(), set()
    for name in supernodes:
        service = services[name]
        node_flags, node_mounts = flags(command_of(service)), mounts(service)
        assert set(node_flags) <= set(docs_supernode), (name, node_flags, docs_supernode)
        assert node_flags["--superlink"] == f"superlink:{port}", name
        assert host_path(node_mounts[node_flags["--root-certificates"]]) == (DEPLOY / "certs" / "ca.crt").resolve()
        keys.add(host_path(node_mounts[node_flags["--auth-supernode-private-key"]]))
        node_config = dict(item.split("=", 1) for item in shlex.split(node_flags["--node-config"]))
        assert "partition-id" not in node_config and node_config["data-dir"] in node_mounts, (name, node_config)
        data_folders.add(host_path(node_mounts[node_config["data-dir"]]))
        client_ids.add(node_config["client-id"])
        assert "register" in service["depends_on"], name
    assert len(data_folders) == len(keys) == len(client_ids) == len(supernodes), (data_folders, keys, client_ids)
    assert all(folder.parent == (DEPLOY / "data").resolve() for folder in data_folders), data_folders

    # The registration: every SuperNode's public key, over a connection to the SuperLink's service name.
    register = services["register"]
    register_command, register_mounts = command_of(register), mounts(register)
    assert register_command[0] == "register_supernodes.sh"
    assert "register_supernodes.sh" in (DEPLOY / "Dockerfile").read_text()  # the image has it on PATH
    registered = {host_path(register_mounts[key]) for key in register_command[2:]}
    assert registered == {key.with_name(key.name + ".pub") for key in keys}
    flwr_config = host_path(register_mounts[f"{register['environment']['FLWR_HOME']}/config.toml"])
    connection = tomllib.loads(flwr_config.read_text())["superlink"][register_command[1]]
    assert connection["address"] == f"superlink:{port}"
    assert host_path(register_mounts[connection["root-certificates"]]) == (DEPLOY / "certs" / "ca.crt").resolve()
    print(f"compose file checked by {checked_by}: {len(supernodes)} SuperNodes")
