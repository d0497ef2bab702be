from lightning_disttrain.loggers import AutoWandbLogger


def test_wandb_offline_without_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert AutoWandbLogger(project="p", save_dir=str(tmp_path))._offline is True


def test_wandb_online_with_a_key_unless_mode_says_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert AutoWandbLogger(project="p", save_dir=str(tmp_path))._offline is False
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert AutoWandbLogger(project="p", save_dir=str(tmp_path))._offline is True
    assert AutoWandbLogger(project="p", save_dir=str(tmp_path), offline=False)._offline is False
