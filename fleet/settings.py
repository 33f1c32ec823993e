"""Fleet's one settings module, driven by the environment (see .env.example).

With nothing set, the head runs on the embedded default: SQLite in WAL mode, the in-memory channel
layer, a local-memory cache and a filesystem Celery broker that a separate worker process can consume.
DATABASE_URL switches the database to PostgreSQL; REDIS_URL switches the channel layer, the cache, the
placement state and Celery to Redis.
"""

import os
import secrets
import sys
from pathlib import Path

import dj_database_url

from fleet.heap import DEFAULT_GC_THRESHOLDS, gc_thresholds
from nodes.link.logs import PLAIN as PLAIN_LOG_FORMAT
from nodes.link.logs import log_format

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


FLEET_HOME = Path(os.environ.get("FLEET_HOME") or BASE_DIR / ".fleet").resolve()
FLEET_HOME.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    """SECRET_KEY from the environment, or one generated on first start and kept in FLEET_HOME."""
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    path = FLEET_HOME / "secret_key"
    if not path.exists():
        # O_EXCL: two processes starting together must not write two different keys.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
# Old keys, newest first, still accepted for reading: sessions, signed values and the fleet's sealed secrets
# (token secrets, the head's link key) stay readable after SECRET_KEY is rotated.
SECRET_KEY_FALLBACKS = [k.strip() for k in os.environ.get("FLEET_SECRET_KEY_FALLBACKS", "").split(",") if k.strip()]
DEBUG = env_bool("FLEET_DEBUG")
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("FLEET_ALLOWED_HOSTS", "*").split(",") if h.strip()]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("FLEET_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "fleet",
    "nodes",
    "sessions.apps.InferenceSessionsConfig",
    "api",
]

# Django's stock list and WhiteNoise (the generation endpoints never pass through it: api/streaming_app.py).
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "fleet.urls"
ASGI_APPLICATION = "fleet.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("FLEET_SQLITE_PATH") or str(FLEET_HOME / "fleet.sqlite3"),
            "OPTIONS": {
                # WAL lets the head, the Celery worker and readers work side by side; IMMEDIATE
                # transactions take the write lock up front, so a busy database waits instead of failing.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "").strip()
# One Redis can serve several fleets (or test runs): every key and channel name starts with this prefix.
FLEET_REDIS_PREFIX = os.environ.get("FLEET_REDIS_PREFIX", "fleet:")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # The default capacity of 100 raised ChannelFull under a token stream; batches keep
            # the message rate low, and a larger capacity absorbs bursts.
            # redis-py 8 reads with a 5 s socket timeout, the same as channels-redis's blocking pop: without a
            # longer one, an idle consumer's receive fails with "Timeout reading" and takes its websocket down.
            # redis-py 8 caps an asyncio pool at 100 connections; every send in flight holds one, and two heads
            # at 1,000 streams had more (MaxConnectionsError in the channel layer).
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 60,
                                  "max_connections": env_int("FLEET_REDIS_LAYER_CONNECTIONS", 1000)}],
                       "capacity": 2000, "expiry": 30,
                       "prefix": FLEET_REDIS_PREFIX + "asgi"},
        }
    }
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                          "KEY_PREFIX": FLEET_REDIS_PREFIX + "cache"}}
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "fleet"}}
    # A filesystem broker: a separate `celery worker` process on this machine really consumes it.
    _broker_dir = FLEET_HOME / "celery" / "broker"
    _broker_dir.mkdir(parents=True, exist_ok=True)
    (FLEET_HOME / "celery" / "processed").mkdir(parents=True, exist_ok=True)
    (FLEET_HOME / "celery" / "results").mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://localhost/"  # the folders below are the broker; kombu warns of no host named
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(FLEET_HOME / "celery" / "processed"),
        # Exchange tables (broadcast/pidbox); kombu's default is ./control in the working directory.
        "control_folder": str(FLEET_HOME / "celery" / "control"),
        "store_processed": False,
    }
    CELERY_RESULT_BACKEND = "file://" + str(FLEET_HOME / "celery" / "results")

CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SOFT_TIME_LIMIT = 60
CELERY_TASK_TIME_LIMIT = 90
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "sweep-lost-nodes": {"task": "nodes.tasks.node_sweep_lost", "schedule": 30.0},
    "resume-batches": {"task": "api.tasks.batch_resume", "schedule": float(env_int("FLEET_BATCH_RESUME_S", 15))},
    **{name: {"task": task, "schedule": float(env_int("FLEET_MAINTENANCE_S", 3600))} for name, task in (
        ("expire-sessions", "sessions.tasks.session_expire"), ("expire-handles", "sessions.tasks.handle_expire"),
        ("purge-generations", "sessions.tasks.generation_purge"), ("purge-files", "api.tasks.file_purge"),
        ("purge-media", "nodes.tasks.media_purge"))},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(FLEET_HOME / "celerybeat-schedule")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("FLEET_STATIC_ROOT") or FLEET_HOME / "static")
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# The finders serve the admin's files without `collectstatic` (embedded default: one command, nothing else).
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "api.auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_THROTTLE_CLASSES": ["api.quotas.RequestQuota"],
    "EXCEPTION_HANDLER": "api.errors.management_exception_handler",
    # DRF's parsers, its JSON one refusing JSON nested too deep or holding a lone surrogate (api/json_in.py)
    "DEFAULT_PARSER_CLASSES": ["api.json_in.ClientJSONParser", "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_PAGINATION_CLASS": "api.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Fleet management API",
    "DESCRIPTION": "Nodes, fleet tokens, API keys, sessions, handles and generations of a llama.cpp fleet.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "api.schema.document_errors"],
    # The API speaks JSON (form data is accepted, for DRF's browsable forms, but not documented).
    "PARSER_WHITELIST": ["rest_framework.parsers.JSONParser", "api.json_in.ClientJSONParser"],
    # The docs pages' scripts and styles come from the head itself (drf-spectacular-sidecar), never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# The fleet's own knobs.
# Unset: each node's learned load cost (the prompt tokens it reads in the time one more running generation costs,
# from what its engine measures; nodes/link/placement.py). A number fixes it for every node.
FLEET_LOAD_TOKENS = env_int("FLEET_LOAD_TOKENS", None)
FLEET_DEFAULT_DEADLINE_MS = env_int("FLEET_DEFAULT_DEADLINE_MS", 60_000)
FLEET_HEARTBEAT_S = env_int("FLEET_HEARTBEAT_S", 5)
FLEET_NODE_TIMEOUT_S = env_int("FLEET_NODE_TIMEOUT_S", 20)
# A head told to stop (SIGTERM, SIGINT) lets its running generations finish this long, then ends the rest with an
# error event (fleet/shutdown.py); new requests get a 503 with Retry-After meanwhile.
FLEET_SHUTDOWN_GRACE_S = env_int("FLEET_SHUTDOWN_GRACE_S", 30)
# A node that has not accepted a generation this long after it was sent (a silent node: its link and heartbeats up,
# its engine answering nothing) has it placed elsewhere, and takes no more until its next heartbeat; four times this
# for one with media the node fetches first.
FLEET_ACCEPT_TIMEOUT_S = env_int("FLEET_ACCEPT_TIMEOUT_S", 20)
FLEET_MAX_HANDSHAKES = env_int("FLEET_MAX_HANDSHAKES", 8)
# Of those, at most this many from one address (loopback exempt: local nodes), each stage done within this long.
FLEET_MAX_HANDSHAKES_PER_ADDRESS = env_int("FLEET_MAX_HANDSHAKES_PER_ADDRESS", 2)
FLEET_HANDSHAKE_STAGE_S = env_int("FLEET_HANDSHAKE_STAGE_S", 3)
FLEET_MDNS = env_bool("FLEET_MDNS", True)
# A head served by daphne (not `manage.py up`) announces itself by mDNS when this names the address nodes should
# dial: "host:port", or ":port" for this machine's LAN address.
FLEET_ANNOUNCE = os.environ.get("FLEET_ANNOUNCE", "").strip()
if FLEET_ANNOUNCE and not FLEET_ANNOUNCE.rpartition(":")[2].isdigit():
    sys.stderr.write(f"fleet: FLEET_ANNOUNCE must be host:port or :port, not {FLEET_ANNOUNCE!r}\n")
    sys.exit(2)
# Where nodes reach this head process's node link (ws://host:port/ws/node/): with several head processes every node
# keeps a link to each, at the URL each announces. Default: the address daphne serves (its -b/-p), else FLEET_ANNOUNCE.
FLEET_LINK_URL = os.environ.get("FLEET_LINK_URL", "").strip()
# Per-API-key quotas (0: unlimited), counted in Redis when REDIS_URL is set so every head process counts together;
# a key's own figures in the admin replace these. Tokens are uncached prompt tokens plus completion tokens.
FLEET_QUOTA_REQUESTS_PER_MINUTE = env_int("FLEET_QUOTA_REQUESTS_PER_MINUTE", 600)
FLEET_QUOTA_TOKENS_PER_MINUTE = env_int("FLEET_QUOTA_TOKENS_PER_MINUTE", 200_000)
FLEET_QUOTA_TOKENS_PER_DAY = env_int("FLEET_QUOTA_TOKENS_PER_DAY", 0)
FLEET_QUOTA_CONCURRENT_STREAMS = env_int("FLEET_QUOTA_CONCURRENT_STREAMS", 32)
# The waiting room (fleet/waiting.py): with every lane of a model busy, "fair" hands freed lanes out by priority class,
# then across API keys in turn (by each key's weight), then by deadline; "deadline" by class, then deadline alone.
# A key may have at most FLEET_MAX_WAITING_PER_KEY generations waiting in one head process (0: unbounded; a key's own
# figure in the admin replaces it); one more gets a 429 with Retry-After from the queue's drain rate.
FLEET_WAITING_ORDER = os.environ.get("FLEET_WAITING_ORDER", "fair").strip() or "fair"
if FLEET_WAITING_ORDER not in ("fair", "deadline"):
    sys.stderr.write(f"fleet: FLEET_WAITING_ORDER must be fair or deadline, not {FLEET_WAITING_ORDER!r}\n")
    sys.exit(2)
FLEET_MAX_WAITING_PER_KEY = env_int("FLEET_MAX_WAITING_PER_KEY", 0)
# Classes whose generations, finding no free lane, preempt a running one of a lower interactive class (comma-separated,
# e.g. "high"); it continues later from its tokens. Batch lines are preempted by every interactive class whatever this.
FLEET_PREEMPTING_CLASSES = frozenset(c.strip() for c in os.environ.get("FLEET_PREEMPTING_CLASSES", "").split(",")
                                     if c.strip())
if FLEET_PREEMPTING_CLASSES - {"high", "normal"}:
    sys.stderr.write(f"fleet: FLEET_PREEMPTING_CLASSES names classes that may preempt a lower one: high, normal; not "
                     f"{', '.join(sorted(FLEET_PREEMPTING_CLASSES - {'high', 'normal'}))}\n")
    sys.exit(2)
# Classes within which a key that finds no free lane takes one from a key of its class holding more than its weight's
# share of the model's lanes here (comma-separated, e.g. "normal"); the generation it takes continues later from its
# tokens. Empty (default): within a class a key waits for the next lane to free, first in turn.
FLEET_SHARE_PREEMPTING_CLASSES = frozenset(c.strip() for c in
                                           os.environ.get("FLEET_SHARE_PREEMPTING_CLASSES", "").split(",") if c.strip())
if _unknown := FLEET_SHARE_PREEMPTING_CLASSES - {"high", "normal", "low"}:
    sys.stderr.write("fleet: FLEET_SHARE_PREEMPTING_CLASSES names classes within which a key takes a lane from one "
                     f"over its share: high, normal, low; not {', '.join(sorted(_unknown))}\n")
    sys.exit(2)
# Only `manage.py up` sets this, for its own head and node processes: a token made for that run under the reserved
# id "local", accepted only from loopback and never through a proxy. Unset everywhere else: every node needs a token.
FLEET_LOCAL_NODE_TOKEN = os.environ.get("FLEET_LOCAL_NODE_TOKEN", "").strip()
# Proxies in front of the head (addresses or CIDR networks, comma-separated): a peer at one of these addresses is a
# proxy relaying someone else, never a node on this host.
FLEET_TRUSTED_PROXIES = [p.strip() for p in os.environ.get("FLEET_TRUSTED_PROXIES", "").split(",") if p.strip()]
# What the head takes from one node: frames a second (sustained, with bursts of twice that) and bytes a frame.
FLEET_LINK_MAX_FRAMES_PER_S = env_int("FLEET_LINK_MAX_FRAMES_PER_S", 2000)
# ... or, once a node registered, this many a second for each of its lanes (up to 1,024 lanes) when that is more:
# 200 lanes at 40 tokens a second are 8,000 messages a second (a bundle's messages count one each).
FLEET_LINK_MAX_FRAMES_PER_LANE_S = env_int("FLEET_LINK_MAX_FRAMES_PER_LANE_S", 64)
FLEET_LINK_MAX_FRAME_BYTES = env_int("FLEET_LINK_MAX_FRAME_BYTES", 4 * 1024 * 1024)
# Input limits: a request body (and a client websocket message) over FLEET_MAX_BODY_BYTES is a 413 before Django
# reads it; a chat with more than FLEET_MAX_MESSAGES messages is a 400.
FLEET_MAX_BODY_BYTES = env_int("FLEET_MAX_BODY_BYTES", 4 * 1024 * 1024)
FLEET_MAX_MESSAGES = env_int("FLEET_MAX_MESSAGES", 1024)
# An audio file sent to /v1/audio/transcriptions: larger is a 413 (OpenAI's own limit is 25 MB).
FLEET_MAX_AUDIO_BYTES = env_int("FLEET_MAX_AUDIO_BYTES", 25 * 1024 * 1024)
# An image in a chat message (decoded bytes; a data URL also counts against FLEET_MAX_BODY_BYTES) and its pixels.
FLEET_MAX_IMAGE_BYTES = env_int("FLEET_MAX_IMAGE_BYTES", 4 * 1024 * 1024)
FLEET_MAX_IMAGE_PIXELS = env_int("FLEET_MAX_IMAGE_PIXELS", 4096 * 4096)
# Remote http(s) image URLs the head fetches: none by default (server-side request forgery; fleets often have no
# internet); "*" for any host, or a comma-separated list of hosts. Each fetch gets FLEET_MEDIA_REMOTE_TIMEOUT_S seconds
# in all and at most FLEET_MAX_IMAGE_BYTES; redirects are not followed.
FLEET_MEDIA_REMOTE_URLS = {h.strip().lower() for h in os.environ.get("FLEET_MEDIA_REMOTE_URLS", "").split(",")
                           if h.strip()}
FLEET_MEDIA_REMOTE_TIMEOUT_S = env_int("FLEET_MEDIA_REMOTE_TIMEOUT_S", 10)
DATA_UPLOAD_MAX_MEMORY_SIZE = FLEET_MAX_BODY_BYTES

# /metrics answers a scraper that sends `Authorization: Bearer <this>` (or a staff session); unset: staff only.
FLEET_METRICS_TOKEN = os.environ.get("FLEET_METRICS_TOKEN", "").strip()
# The model registry (files in FLEET_HOME/blobs/): a node's grant to pull a model lasts this many seconds (a pull that
# needs longer asks for another); uploads come in parts of at most FLEET_MAX_BODY_BYTES, one request each.
FLEET_PULL_GRANT_S = env_int("FLEET_PULL_GRANT_S", 900)

# Threads that write generation records, each keeping its database connection open (SQLite takes one writer at a time);
# 0: each record on its request's own thread and connection (the tests' setting: tests/conftest.py).
FLEET_RECORD_WRITERS = env_int("FLEET_RECORD_WRITERS", 4 if DATABASE_URL else 1)
# How long a record's write waits for a database that cannot be reached (an outage), retrying, before it is lost.
FLEET_RECORD_RETRY_S = env_int("FLEET_RECORD_RETRY_S", 300)
# Freeze what the head loaded before serving out of the garbage collector's full collections (fleet/heap.py).
FLEET_GC_FREEZE = env_bool("FLEET_GC_FREEZE", True)
# The head's garbage collector thresholds (gc.set_threshold: generations 0, 1 and 2) as "a,b,c"; empty for Python's
# own 700,10,10 (fleet/heap.py; measured at 500 streams in docs/benchmarks.md, *Scale*).
try:
    FLEET_GC_THRESHOLDS = gc_thresholds(os.environ.get("FLEET_GC_THRESHOLDS", DEFAULT_GC_THRESHOLDS))
except ValueError as exc:
    sys.stderr.write(f"fleet: {exc}\n")
    sys.exit(2)

# On-demand models (nodes.on_demand): each replica's lanes and context (a deployment of the model sets its own), and
# when a model's generations wait longer than SCALE_WAIT_S (p50 over SCALE_WINDOW_S) one more replica is loaded.
FLEET_ON_DEMAND_LANES = env_int("FLEET_ON_DEMAND_LANES", 4)
FLEET_ON_DEMAND_CONTEXT = env_int("FLEET_ON_DEMAND_CONTEXT", 2048)
FLEET_ON_DEMAND_SCALE_WAIT_S = float(os.environ.get("FLEET_ON_DEMAND_SCALE_WAIT_S", "2"))
FLEET_ON_DEMAND_SCALE_WINDOW_S = env_int("FLEET_ON_DEMAND_SCALE_WINDOW_S", 30)

# Batches (/v1/batches): a Celery worker sends each line to a head process's /v1 at this address.
FLEET_HEAD_URL = os.environ.get("FLEET_HEAD_URL", "http://127.0.0.1:8000").strip().rstrip("/")
FLEET_BATCH_CONCURRENCY = env_int("FLEET_BATCH_CONCURRENCY", 8)  # lines one batch run sends at once
FLEET_BATCH_SHARE = float(os.environ.get("FLEET_BATCH_SHARE", "0.5"))  # of a model's lanes, with interactive traffic
FLEET_BATCH_FILE_MAX_BYTES = env_int("FLEET_BATCH_FILE_MAX_BYTES", 50 * 1024 * 1024)
FLEET_BATCH_LINE_TIMEOUT_S = env_int("FLEET_BATCH_LINE_TIMEOUT_S", 600)
FLEET_BATCH_SLICE_S = env_int("FLEET_BATCH_SLICE_S", 600)  # one task's run; the next slice is enqueued after it
FLEET_BATCH_LEASE_S = env_int("FLEET_BATCH_LEASE_S", 30)  # a runner silent this long is taken for dead

# Maintenance (Celery beat, every FLEET_MAINTENANCE_S): in days, 0 keeps forever. A session untouched this long is
# deleted with its messages; a handle no generation named this long is freed; generation records and batch files
# older than their retention are deleted (a file an unfinished batch reads or writes is kept), and so are media blobs
# (audio a request sent) no request sent for FLEET_MEDIA_RETENTION_DAYS (a model's file is kept).
FLEET_SESSION_TTL_DAYS = env_int("FLEET_SESSION_TTL_DAYS", 30)
FLEET_HANDLE_TTL_DAYS = env_int("FLEET_HANDLE_TTL_DAYS", 30)
FLEET_GENERATION_RETENTION_DAYS = env_int("FLEET_GENERATION_RETENTION_DAYS", 90)
FLEET_FILE_RETENTION_DAYS = env_int("FLEET_FILE_RETENTION_DAYS", 30)
FLEET_MEDIA_RETENTION_DAYS = env_int("FLEET_MEDIA_RETENTION_DAYS", 7)

# plain, or json: one JSON object a line, with gen_id on every line about a generation (node_join honours it too).
try:
    FLEET_LOG_FORMAT = log_format(os.environ.get("FLEET_LOG_FORMAT"))
except ValueError as exc:  # the head and every manage.py command stop here: one line, not a traceback
    sys.stderr.write(f"fleet: {exc}\n")
    sys.exit(2)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"gen_id": {"()": "nodes.link.logs.GenIdFilter"},
                "answered": {"()": "nodes.link.logs.AnsweredStatusFilter"}},
    "formatters": {"plain": {"format": PLAIN_LOG_FORMAT}, "json": {"()": "nodes.link.logs.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": FLEET_LOG_FORMAT, "filters": ["gen_id"]}},
    "loggers": {
        "fleet": {"handlers": ["console"], "level": os.environ.get("FLEET_LOG_LEVEL", "INFO"), "propagate": False},
        "nodes": {"handlers": ["console"], "level": os.environ.get("FLEET_LOG_LEVEL", "INFO"), "propagate": False},
        "api": {"handlers": ["console"], "level": os.environ.get("FLEET_LOG_LEVEL", "INFO"), "propagate": False},
        "sessions": {"handlers": ["console"], "level": os.environ.get("FLEET_LOG_LEVEL", "INFO"), "propagate": False},
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False, "filters": ["answered"]},
    },
}
