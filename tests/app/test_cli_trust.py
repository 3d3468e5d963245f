"""`p2psync keygen` and `p2psync inspect` on manifests."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from node.cli import main
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import load_public_key, load_signing_key
from p2p_sync.trust.manifest import SNAPSHOT, SwarmPolicy, sign
from tests.helpers import heavy_modules_after


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_keygen_writes_private_0600_and_one_line_public(tmp_path: Path, capsys) -> None:
    key = tmp_path / "trainer.key"
    code, out, _ = run(capsys, "keygen", "--out", key)
    assert code == 0
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    pub_text = (tmp_path / "trainer.key.pub").read_text()
    assert pub_text.count("\n") == 1 and pub_text.strip() in out
    assert load_signing_key(key).public == load_public_key(str(tmp_path / "trainer.key.pub"))


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    key = tmp_path / "trainer.key"
    run(capsys, "keygen", "--out", key)
    before = key.read_bytes()
    code, _, err = run(capsys, "keygen", "--out", key)
    assert code == 1 and "--force" in err and key.read_bytes() == before
    code, _, _ = run(capsys, "keygen", "--out", key, "--force")
    assert code == 0 and key.read_bytes() != before


@pytest.fixture()
def signed_manifest(tmp_path: Path, capsys) -> tuple[Path, Path]:
    key_path = tmp_path / "t.key"
    run(capsys, "keygen", "--out", key_path)
    key = load_signing_key(key_path)
    policy = SwarmPolicy("lab", (key.public,))
    m = manifest_for(
        b"x" * 100_000,
        swarm=policy.swarm_id,
        version=0,
        kind=SNAPSHOT,
        target_state="aa" * 16,
        layout="bb" * 16,
        now=2_000_000_000,
    )
    path = tmp_path / "v0.manifest"
    path.write_bytes(sign(m, [key]))
    return path, tmp_path / "t.key.pub"


def test_inspect_shows_and_verifies_a_manifest(signed_manifest, capsys) -> None:
    path, pub = signed_manifest
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "NOT verified" in out and "100,000 bytes" in out
    code, out, _ = run(capsys, "inspect", path, "--trust", pub, "--swarm", "lab")
    assert code == 0 and "verified: signed by the trusted key" in out
    code, out, _ = run(capsys, "inspect", path, "--json")
    assert json.loads(out)["signed"]["version"] == 0


def test_inspect_refuses_a_manifest_of_another_swarm_or_key(signed_manifest, capsys, tmp_path):
    path, pub = signed_manifest
    code, _, err = run(capsys, "inspect", path, "--trust", pub, "--swarm", "other")
    assert code == 1 and "swarm" in err and err.count("\n") == 1
    run(capsys, "keygen", "--out", tmp_path / "x.key")
    code, _, err = run(capsys, "inspect", path, "--trust", tmp_path / "x.key.pub", "--swarm", "lab")
    assert code == 1 and "untrusted" in err


def test_inspect_handles_patches_too(tmp_path: Path, capsys, tiny_versions) -> None:
    from safetensors.torch import save_file

    a, b, p = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "ab.patch"
    save_file(tiny_versions[0], a)
    save_file(tiny_versions[1], b)
    run(capsys, "patch", "create", "--base", a, "--new", b, "--out", p, "--device", "cpu")
    code, out, _ = run(capsys, "inspect", p)
    assert code == 0 and "p2psync patch v2" in out  # positions coded by the base's exponents


def test_inspect_reads_a_manifest_without_the_codec(signed_manifest) -> None:
    """A manifest is told from a patch by the patch's magic bytes, kept where reading them
    imports no torch (the codec's own): ``inspect`` on a manifest answers without it."""
    from node import trust_cmd
    from p2p_sync import codec

    assert trust_cmd.PATCH_MAGIC == codec.MAGIC
    path, _ = signed_manifest
    done = heavy_modules_after(f"print(main(['inspect', {str(path)!r}]))")
    assert "NOT verified" in done.stdout
    assert done.stdout.splitlines()[-2:] == ["0", "[]"], done.stdout + done.stderr


def test_inspect_names_a_file_it_cannot_read(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "inspect", tmp_path / "none.manifest")
    assert code == 1 and "cannot read manifest or patch" in err and err.count("\n") == 1
