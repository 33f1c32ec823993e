"""Settings with and without the environment variables (each read in a fresh interpreter)."""

import json
import os
import subprocess
import sys

from tests.live import ROOT

PROBE = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'db': s.DATABASES['default']['ENGINE'], 'opts': s.DATABASES['default'].get('OPTIONS', {}), "
    "'layer': s.CHANNEL_LAYERS['default']['BACKEND'], 'cache': s.CACHES['default']['BACKEND'], "
    "'broker': s.CELERY_BROKER_URL, 'debug': s.DEBUG, 'key': s.SECRET_KEY}))"
)


def read_settings(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "FLEET_DEBUG"}}
    base.update({"FLEET_HOME": str(tmp_path), "DJANGO_SETTINGS_MODULE": "fleet.settings", **env})
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_embedded_default(tmp_path):
    s = read_settings(tmp_path)
    assert s["db"] == "django.db.backends.sqlite3"
    assert "journal_mode=WAL" in s["opts"]["init_command"] and s["opts"]["timeout"] >= 5
    assert s["layer"] == "channels.layers.InMemoryChannelLayer"
    assert s["cache"] == "django.core.cache.backends.locmem.LocMemCache"
    assert s["broker"] == "filesystem://localhost/"
    assert s["debug"] is False
    # The generated key is kept: a second start reads the same one.
    assert (tmp_path / "secret_key").exists() and read_settings(tmp_path)["key"] == s["key"]


def test_database_and_redis_urls(tmp_path):
    s = read_settings(tmp_path, DATABASE_URL="postgres://u@127.0.0.1:5432/test", REDIS_URL="redis://127.0.0.1:6379/0",
                      SECRET_KEY="from-env", FLEET_DEBUG="1")
    assert s["db"] == "django.db.backends.postgresql"
    assert s["layer"] == "channels_redis.core.RedisChannelLayer"
    assert s["cache"] == "django.core.cache.backends.redis.RedisCache"
    assert s["broker"] == "redis://127.0.0.1:6379/0"
    assert s["key"] == "from-env" and s["debug"] is True
