"""One configuration: every option is a field of a frozen dataclass in sgl/runtime/config.py;
the CLI flags and environment variables are generated from the fields and parsed by type."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sgl import launch_server
from sgl.runtime import config
from sgl.runtime.config import EngineConfig, Settings, cache_dir, env_name, settings

ALL_FIELDS = {f.name: f for cls in (EngineConfig, Settings) for f in dataclasses.fields(cls)}


@pytest.fixture
def clean_env(monkeypatch):
    """No option variables from the outer environment (tests set their own)."""
    for f in ALL_FIELDS.values():
        monkeypatch.delenv(env_name(f), raising=False)
    return monkeypatch


def test_every_field_has_help_and_appears_in_launch_server_help():
    text = launch_server.build_parser().format_help()
    for name, f in ALL_FIELDS.items():
        assert f.metadata["help"], name
        assert "--" + name.replace("_", "-") in text, name
        assert env_name(f) in text, name


def test_former_environment_switches_are_config_fields():
    settings_vars = {env_name(f) for f in dataclasses.fields(Settings)}
    assert {"SGL_DISABLE_CPU_OPS", "SGL_DISABLE_CPU_ATTENTION", "SGL_REGEX_BACKEND", "SGL_LAZY_DFA",
            "SGL_PUSHDOWN_LAZY", "SGL_GRAMMAR_CACHE_ENTRIES", "SGL_GRAMMAR_DISK_CACHE", "SGL_CACHE_DIR",
            "TRITON_INTERPRET", "CC"} <= settings_vars
    # The C decode kernel is chosen per engine (the model runner), so its switches are engine options.
    engine_vars = {env_name(f) for f in dataclasses.fields(EngineConfig)}
    assert {"SGL_DISABLE_CPU_DECODE_KERNEL", "SGL_CPU_DECODE_THREADS", "SGL_DISABLE_PACKED_LINEARS"} <= engine_vars


def test_defaults_without_variables(clean_env):
    s = settings()
    assert (s.regex_backend, s.lazy_dfa, s.grammar_cache_entries) == ("native", "native", 256)
    assert s.pushdown_lazy and s.grammar_disk_cache and not s.disable_cpu_ops
    assert EngineConfig.from_kwargs() == EngineConfig()


@pytest.mark.parametrize("var, raw, field, value", [
    ("SGL_DISABLE_CPU_OPS", "yes", "disable_cpu_ops", True),  # bool
    ("SGL_GRAMMAR_DISK_CACHE", "0", "grammar_disk_cache", False),  # bool, on by default
    ("SGL_PUSHDOWN_LAZY", "Off", "pushdown_lazy", False),
    ("SGL_GRAMMAR_CACHE_ENTRIES", "7", "grammar_cache_entries", 7),  # int
    ("SGL_REGEX_BACKEND", "Outlines", "regex_backend", "outlines"),  # str with choices: case-insensitive
    ("SGL_CACHE_DIR", "/tmp/Some Dir", "cache_dir", "/tmp/Some Dir"),  # Optional[str], kept as is
    ("TRITON_INTERPRET", "1", "triton_interpret", True),  # another tool's variable
])
def test_variable_sets_setting(clean_env, var, raw, field, value):
    clean_env.setenv(var, raw)
    assert getattr(settings(), field) == value
    clean_env.setenv(var, "")  # empty is unset
    assert getattr(settings(), field) == ALL_FIELDS[field].default


@pytest.mark.parametrize("var, raw, field, value", [
    ("SGL_MEM_FRACTION", "0.25", "mem_fraction", 0.25),  # float
    ("SGL_MAX_TOTAL_TOKENS", "4096", "max_total_tokens", 4096),  # Optional[int]
    ("SGL_DISABLE_RADIX_CACHE", "true", "disable_radix_cache", True),
    ("SGL_DEVICE", "cpu", "device", "cpu"),  # str
    ("SGL_CACHE_DIR", "/tmp/x", "cache_dir", "/tmp/x"),  # shared with Settings
    ("SGL_CPU_DECODE_THREADS", "1", "cpu_decode_threads", 1),  # Optional[int] with choices
])
def test_variable_sets_engine_option(clean_env, var, raw, field, value):
    clean_env.setenv(var, raw)
    assert getattr(EngineConfig.from_kwargs(), field) == value
    assert getattr(EngineConfig.from_kwargs(**{field: ALL_FIELDS[field].default}), field) == ALL_FIELDS[field].default


@pytest.mark.parametrize("var, raw, expected", [
    ("SGL_GRAMMAR_CACHE_ENTRIES", "many", "an integer"),
    ("SGL_DISABLE_CPU_OPS", "maybe", "a boolean"),
    ("SGL_REGEX_BACKEND", "nope", "one of native, lazy, outlines"),
    ("SGL_CPU_DECODE_THREADS", "3", "one of 1, 2"),
    ("SGL_MEM_FRACTION", "half", "a number"),
    ("SGL_SCHEDULE_POLICY", "random", "one of lpm, fcfs, dfs-weight"),
])
def test_bad_value_names_the_variable(clean_env, var, raw, expected):
    clean_env.setenv(var, raw)
    with pytest.raises(ValueError, match=f"{var}='{raw}': expected {expected}"):
        EngineConfig.from_kwargs()


def test_explicit_values_are_checked_too():
    with pytest.raises(ValueError, match="cpu_decode_threads must be one of 1, 2"):
        EngineConfig.from_kwargs(cpu_decode_threads=4)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_kwargs(regex_backend="lazy")  # a process-wide setting, not an engine option


@pytest.mark.parametrize("kwargs, message", [
    ({"hicache_ratio": "2.0"}, r"hicache_ratio must be a number \(int or float\); got '2.0' \(str\)"),
    ({"page_size": "16"}, r"page_size must be an int; got '16' \(str\)"),
    ({"page_size": True}, r"page_size must be an int; got True \(bool\)"),
    ({"enable_hierarchical_cache": 1}, r"enable_hierarchical_cache must be True or False; got 1 \(int\)"),
    ({"model_path": 3}, r"model_path must be a str; got 3 \(int\)"),
])
def test_explicit_values_of_the_wrong_type_name_the_field(kwargs, message):
    # Explicit Python arguments skip the CLI/variable parser: without the check a string
    # ratio failed later as "'<=' not supported between instances of 'str' and 'int'".
    with pytest.raises(TypeError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_explicit_values_of_compatible_types_pass():
    c = EngineConfig.from_kwargs(hicache_ratio=2, mem_fraction=0.1, model_path=None, enable_hierarchical_cache=True)
    assert (c.hicache_ratio, c.enable_hierarchical_cache) == (2, True)


def test_settings_follow_the_environment(clean_env):
    assert not settings().disable_cpu_attention
    clean_env.setenv("SGL_DISABLE_CPU_ATTENTION", "1")
    assert settings().disable_cpu_attention
    assert settings() is settings()  # parsed once per distinct environment


def test_cache_dir_resolution(clean_env, tmp_path):
    assert cache_dir() == Path.home() / ".cache" / "sgl"
    clean_env.setenv("SGL_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cache_dir(tmp_path / "mine") == tmp_path / "mine"  # an Engine's explicit cache_dir wins


def test_cli_flags_parse_by_type_and_export_settings(clean_env):
    p = launch_server.build_parser()
    args = p.parse_args(["--max-total-tokens", "512", "--no-grammar-disk-cache", "--regex-backend", "OUTLINES",
                         "--disable-cpu-ops", "--cache-dir", "/x"])
    assert config.given(args, EngineConfig) == {"max_total_tokens": 512, "cache_dir": "/x"}
    process_wide = config.given(args, Settings)
    assert process_wide == {"grammar_disk_cache": False, "regex_backend": "outlines", "disable_cpu_ops": True,
                            "cache_dir": "/x"}
    for var, text in config.to_env(process_wide).items():
        clean_env.setenv(var, text)
    s = settings()
    assert (s.grammar_disk_cache, s.regex_backend, s.disable_cpu_ops, s.cache_dir) == (False, "outlines", True, "/x")


def test_cli_bad_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        launch_server.build_parser().parse_args(["--cpu-decode-threads", "5"])
    assert "--cpu-decode-threads='5': expected one of 1, 2" in capsys.readouterr().err


def test_launch_server_rejects_bad_variable_before_loading(clean_env, capsys):
    clean_env.setenv("SGL_GRAMMAR_CACHE_ENTRIES", "lots")
    with pytest.raises(SystemExit) as e:
        launch_server.main([])
    assert e.value.code == 2
    assert "SGL_GRAMMAR_CACHE_ENTRIES='lots': expected an integer" in capsys.readouterr().err


def test_no_module_reads_the_environment_but_config():
    # Allowed: config.py (the registry) and OMP's default before torch loads.
    root = Path(config.__file__).parents[1]
    allowed = {"runtime/config.py", "runtime/__init__.py"}
    readers = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in allowed:
            continue
        text = path.read_text()
        if "os.environ" in text or "os.getenv" in text:
            readers.append(rel)
    assert readers == []
