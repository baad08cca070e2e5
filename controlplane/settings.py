"""Settings for the control plane, read from the environment (django-environ).

Laptop defaults: a SQLite file under var/, Redis on localhost. Production: set DATABASE_URL
(PostgreSQL), REDIS_URL, DJANGO_SECRET_KEY, DJANGO_ALLOWED_HOSTS and DJANGO_DEBUG=false.
"""
import os
from pathlib import Path
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured
import environ

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("CONTROLPLANE_VAR_DIR") or BASE_DIR / "var")  # the embedded database, logs, ...
VAR_DIR.mkdir(exist_ok=True)

env = environ.Env()
if (BASE_DIR / ".env").exists():
    environ.Env.read_env(BASE_DIR / ".env")

# The laptop default is published: controlplane.settings_production refuses to start with it.
INSECURE_DEFAULT_SECRET_KEY = "insecure-laptop-default-change-me-in-production"
SECRET_KEY = env("DJANGO_SECRET_KEY", default=INSECURE_DEFAULT_SECRET_KEY)
REQUIRE_STRONG_SECRET_KEY = False  # production settings: True
# Secrets stored in the database (endpoint API keys) are encrypted with these Fernet keys (the first encrypts,
# any decrypts: rotation); empty: one derived from SECRET_KEY (controlplane/fieldcrypt.py).
FIELD_ENCRYPTION_KEYS = env.list("FIELD_ENCRYPTION_KEYS", default=[])
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

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
    "knox",  # API tokens stored hashed, with an expiry (controlplane.api.auth)
    "drf_spectacular",
    "drf_spectacular_sidecar",  # the API docs' scripts, served from here (no CDN)
    "axes",  # failed-login lockout
    "controlplane.datasets",
    "controlplane.endpoints",
    "controlplane.jobs",
    "controlplane.dashboard",
    "controlplane.api",
    "controlplane.diagnostics",
    "controlplane.profiling",
    "controlplane.monitoring",
    "controlplane.alerts",
    "controlplane.exports",
]

# manage.py collect_rollouts (the drop-in CLI) serves no page: without daphne (it only adds `runserver` over ASGI)
# the command's start skips importing twisted (~0.1-0.6 s). manage.py sets this for that command only.
# Nor does it need the admin site's registrations (autodiscover imports every app's admin module and, through
# them, Celery): SimpleAdminConfig keeps the admin app and its tables without them.
if os.environ.get("CONTROLPLANE_LEAN_CLI") == "1":
    INSTALLED_APPS.remove("daphne")
    INSTALLED_APPS[INSTALLED_APPS.index("django.contrib.admin")] = "django.contrib.admin.apps.SimpleAdminConfig"

MIDDLEWARE = [
    # first, so it sees the response that goes out: a request's place among its user's open ones
    # (controlplane.inflight) is freed when that response is closed
    "controlplane.inflight.ReleaseOnCloseMiddleware",
    # X-Forwarded-* only from WEB_TRUSTED_PROXY_ADDRS, before anything reads the client's address
    "controlplane.forwarded.TrustedProxyMiddleware",
    # /healthz and /metrics for probes and Prometheus, before host checks and the HTTPS redirect
    "controlplane.monitoring.middleware.ProbeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a locked-out login into its 429 page
]

# --- Logins: django-axes locks a username + address out after repeated failures (the login pages, the
# admin and POST /api/auth/token/ alike). The address is the real client's (see WEB_TRUSTED_PROXIES).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=10)
AXES_COOLOFF_TIME = env.float("AXES_COOLOFF_HOURS", default=0.25)  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# Proxies in front of the web server that append to X-Forwarded-For (0: the peer address is the client;
# docker/compose.yml: 1, Caddy). A client-supplied X-Forwarded-For is never trusted beyond that.
WEB_TRUSTED_PROXIES = env.int("WEB_TRUSTED_PROXIES", default=0)
# ... and only when the request came from one of these addresses / networks (the proxy's; compose: Caddy's fixed
# address): from any other peer the X-Forwarded-* headers are dropped (controlplane/forwarded.py).
WEB_TRUSTED_PROXY_ADDRS = env.list("WEB_TRUSTED_PROXY_ADDRS", default=["127.0.0.1", "::1"])
AXES_IPWARE_PROXY_COUNT = WEB_TRUSTED_PROXIES or None
AXES_IPWARE_META_PRECEDENCE_ORDER = ["HTTP_X_FORWARDED_FOR", "REMOTE_ADDR"] if WEB_TRUSTED_PROXIES else ["REMOTE_ADDR"]

# --- Security headers: CSP (django-csp); nosniff, same-origin referrers and DENY framing are Django's
# defaults. Scripts and styles come from this site only (inline styles are used by the dashboard).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "font-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

ROOT_URLCONF = "controlplane.urls"
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
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

# --- Database -------------------------------------------------------------------------------
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web and worker write the file at once: WAL, a busy timeout and IMMEDIATE transactions.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
elif env.bool("DB_POOL", default=True):
    # Django's pool (psycopg_pool), one per process. Under ASGI each request's sync code runs on a thread of its
    # own, so a persistent connection (CONN_MAX_AGE) is never used again: every request connected anew (a
    # stream take through uvicorn: 36.5 ms a batch with a connection each, 30 with the pool). The health check
    # (one round trip as a connection is lent) hands out no connection a PostgreSQL restart broke.
    DATABASES["default"].update(CONN_MAX_AGE=0, CONN_HEALTH_CHECKS=True)
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("pool", {
        "min_size": env.int("DB_POOL_MIN_SIZE", default=1),
        "max_size": env.int("DB_POOL_MAX_SIZE", default=40),
        "max_idle": 60.0,  # connections above min_size go after a minute unused
        "timeout": env.float("DB_POOL_TIMEOUT_S", default=30.0),  # all max_size lent: wait this long, then fail
    })
else:
    DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=0))
if DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql"):
    # libpq waits for a connect as long as TCP does (minutes to an address that drops packets); the pool's
    # connects too. /healthz and /metrics bound their own look (controlplane/monitoring/database.py)
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout",
                                                              env.int("DB_CONNECT_TIMEOUT_S", default=10))
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise serves from finders until collectstatic fills it
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
MEDIA_ROOT = env("MEDIA_ROOT", default=str(VAR_DIR / "media"))
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
# Request bodies, refused (413) before any parsing by controlplane.bodylimit: every request, and the
# dataset upload routes for a request with credentials.
REQUEST_MAX_BODY_BYTES = env.int("REQUEST_MAX_BODY_BYTES", default=1024 * 1024)
# A response part the client has not taken within this long: the client is taken as gone (controlplane/senddeadline.py)
WEB_SEND_TIMEOUT_S = env.float("WEB_SEND_TIMEOUT_S", default=60.0)
UPLOAD_MAX_BODY_BYTES = env.int("UPLOAD_MAX_BODY_BYTES", default=1024 * 1024 * 1024)
UPLOAD_PATHS = ["/api/datasets/", "/datasets/upload/"]
# Uploaded files above this size are spooled to disk, never held whole in memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# --- Redis: Celery broker and the Channels layer ---------------------------------------------
REDIS_URL = env("REDIS_URL", default="redis://127.0.0.1:6379/0")

CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
# A lost worker must not lose work: ack after the task ran, requeue on worker loss.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT", default=3600)}
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
# The queue tasks go to when not routed elsewhere (tests run isolated workers on a queue of their own).
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="celery")
# Routing: a job's chunks go to its endpoint's queue, so workers started with `-Q <queue>` on the host
# next to that model server take them. Endpoint.worker_queue wins; else this map of endpoint name ->
# queue (env: JOBS_ENDPOINT_QUEUES="llama-70b=gpu-a,qwen=gpu-b"); else CELERY_TASK_DEFAULT_QUEUE.
JOBS_ENDPOINT_QUEUES = env.dict("JOBS_ENDPOINT_QUEUES", default={})
# The queues a user may give an endpoint (its worker_queue); the default queue and JOBS_ENDPOINT_QUEUES' queues
# are the operator's too. Names Celery/kombu keep for themselves (unacked, *.pidbox, _kombu...) never are
# (controlplane.operator refuses them here at startup, at every way in, and again at dispatch).
JOBS_WORKER_QUEUES = env.list("JOBS_WORKER_QUEUES", default=[])
# The control lane (controlplane/lanes.py): ops actions, weight updates, health, pre-warm, the watchdog and every
# beat task, finalization go to this queue, served by a worker of its own that never holds a chunk ("": off,
# every task on the default queue). Reserved: no endpoint may route chunks to it.
CELERY_CONTROL_QUEUE = env("CELERY_CONTROL_QUEUE", default="control")
CELERY_TASK_ROUTES = ("controlplane.lanes.route_task",)
CELERY_BEAT_SCHEDULE = {
    # Re-dispatch chunks whose worker died (stale lease), flag stalled jobs, finalize stragglers.
    "jobs-watchdog": {"task": "controlplane.jobs.tasks.watchdog", "schedule": env.float("JOBS_WATCHDOG_INTERVAL_S", default=10.0)},
    # Running jobs' MLflow series, appended while they run (controlplane/exports/mlflow_export.py; no query when
    # MLFLOW_TRACKING_URIS is empty).
    "mlflow-live": {"task": "controlplane.exports.tasks.mlflow_live_task", "schedule": env.float("MLFLOW_LIVE_INTERVAL_S", default=15.0)},
}

# --- Tracing (workers/tracing.py) -----------------------------------------------------------------
# OpenTelemetry spans job -> chunk -> rollout -> request, exported over OTLP/HTTP to this traces URL (e.g.
# http://otel-collector:4318/v1/traces); off when empty. TRACING_MODE "spans" makes the spans without exporting
# them (to measure the cost). OTEL_EXPORTER_OTLP_HEADERS (the SDK's own variable) adds headers to each export.
TRACING_OTLP_ENDPOINT = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", default="")
TRACING_MODE = env("TRACING_MODE", default="otlp" if TRACING_OTLP_ENDPOINT else "off")
TRACING_SERVICE_NAME = env("OTEL_SERVICE_NAME", default="rollout-control-plane")
# The share of rollouts traced (chosen by trace id). The OTLP encoding (~0.03-0.05 ms of CPU per span) runs in an
# exporter subprocess per worker process (workers/tracing_export.py), off the worker's CPU path; it still needs
# a spare core where the worker's CPU is the limit (bench/bench_tracing.py).
TRACING_SAMPLE_RATIO = env.float("TRACING_SAMPLE_RATIO", default=1.0)

# --- MLflow export (controlplane/exports/mlflow_export.py) --------------------------------------------
# The tracking servers a job may export its run to, name=URI pairs ("local=sqlite:////srv/mlflow.db,team=https://
# mlflow.example.com"): a job names one (job form, API, CLI); a URI of its own is refused.
MLFLOW_TRACKING_URIS = env.dict("MLFLOW_TRACKING_URIS", default={})
MLFLOW_EXPERIMENT_NAME = env("MLFLOW_EXPERIMENT_NAME", default="rollout-collection")
# name=location of a new experiment's artifacts per server (default: beside a SQLite store; a server's own choice)
MLFLOW_ARTIFACT_LOCATIONS = env.dict("MLFLOW_ARTIFACT_LOCATIONS", default={})
MLFLOW_TABLE_ROWS = env.int("MLFLOW_TABLE_ROWS", default=100)  # rollouts in the run's sampled table
# A second of a running job's series goes to MLflow this long after it ended (its samples are all stored by then).
MLFLOW_LIVE_LAG_S = env.float("MLFLOW_LIVE_LAG_S", default=5.0)

# --- Jobs runtime -----------------------------------------------------------------------------
# A chunk whose worker has not heartbeated for this long is handed out again (SIGKILLed worker).
JOBS_LEASE_TIMEOUT_S = env.float("JOBS_LEASE_TIMEOUT_S", default=30.0)
# Threads per worker process, beside its Celery slots, that take only chunks a dead or stopping worker left
# (controlplane/jobs/resume.py): such a chunk goes on within the lease timeout plus one watchdog interval, even
# while every slot holds a chunk.
JOBS_RESUME_SLOTS = env.int("JOBS_RESUME_SLOTS", default=1)
# Fair capacity (controlplane/jobs/capacity.py): a chunk run stops at this total deadline (handed back, or the job
# failed when it stored nothing); a run checks its owner's share of the workers this often; a chunk over its
# owner's share goes back to the queue with this countdown.
JOBS_CHUNK_DEADLINE_S = env.float("JOBS_CHUNK_DEADLINE_S", default=3600.0)
JOBS_FAIR_SHARE_CHECK_S = env.float("JOBS_FAIR_SHARE_CHECK_S", default=5.0)
JOBS_FAIR_SHARE_RETRY_S = env.float("JOBS_FAIR_SHARE_RETRY_S", default=5.0)
# A running job with no new rollout for this long is flagged stalled (the flag clears on progress).
JOBS_STALL_AFTER_S = env.float("JOBS_STALL_AFTER_S", default=300.0)
# ... and never before one request could have timed out: the threshold of a job is
# max(JOBS_STALL_AFTER_S, its endpoint's request_timeout_s + connect_timeout_s).
# Verification: the engine's process pool for CPU-bound verifiers (per worker process; default: cores),
# calls at once for io / remote verifiers (sandboxed code, LLM judge), and the batch verification job's
# own, higher parallelism.
VERIFY_POOL_PROCESSES = env.int("VERIFY_POOL_PROCESSES", default=0) or None
VERIFY_CONCURRENCY = env.int("VERIFY_CONCURRENCY", default=32)
VERIFY_JOB_PROCESSES = env.int("VERIFY_JOB_PROCESSES", default=4)
VERIFY_JOB_CONCURRENCY = env.int("VERIFY_JOB_CONCURRENCY", default=64)
# The verification cache every worker of a job shares (Redis; "" keeps it per chunk run / per process).
VERIFY_CACHE_URL = env("VERIFY_CACHE_URL", default=REDIS_URL)
VERIFY_CACHE_TTL_S = env.int("VERIFY_CACHE_TTL_S", default=7 * 24 * 3600)
# A worker computing a verification holds a claim this long; the others wait for it at most that long
# (a dead worker's claim expires; a slower verification is then computed twice, never wrong).
VERIFY_CACHE_CLAIM_S = env.float("VERIFY_CACHE_CLAIM_S", default=60.0)
# "measured": a collection run keeps the shared cache only while its hits save more time than its round trips
# cost (measured over its first 256 lookups; a cheap verifier with few hits goes local); "always": Redis always.
VERIFY_CACHE_SHARED = env("VERIFY_CACHE_SHARED", default="measured")
if VERIFY_CACHE_SHARED not in ("measured", "always"):
    raise ImproperlyConfigured(f"VERIFY_CACHE_SHARED must be measured or always, not {VERIFY_CACHE_SHARED!r}")
# --- Verifiers: the operator's knobs. Read from the environment by workers/verifiers too (no Django there).
# Modules imported at start (they register verifiers by name); users may name those verifiers.
VERIFIER_PLUGINS = env.list("VERIFIER_PLUGINS", default=[])
# Modules into which users may name verifiers by dotted path ("mod:func"); any other dotted path is the
# operator's alone (manage.py commands): importing a module runs it, in the web process.
VERIFIER_PATH_MODULES = env.list("VERIFIER_PATH_MODULES", default=[])
# Maxima of verifiers' numeric options over their built-in ones ("code.wall_s=120,judge.concurrency=128"): a job
# asking for more is refused, and options are clamped again where they are used.
VERIFIER_OPTION_MAX = env("VERIFIER_OPTION_MAX", default="")
# The code verifier's sandbox: bubblewrap namespaces, or no code verification at all; "rlimits" is the
# operator's explicit opt-in to the weaker fallback (pages and results say so). Each writable place in the
# sandbox (work directory, /tmp, /dev/shm) is a tmpfs of VERIFIER_SANDBOX_TMPFS_MB.
VERIFIER_SANDBOX = env("VERIFIER_SANDBOX", default="")
VERIFIER_SANDBOX_TMPFS_MB = env.int("VERIFIER_SANDBOX_TMPFS_MB", default=16)
# Rollouts are written in batches of this many rows, or every JOBS_FLUSH_INTERVAL_S.
# A chunk run retries its database work (rollout batches, heartbeats, reads) this long while the database
# is unreachable (a restart, a failover), with exponential backoff, before it gives up.
JOBS_DB_RETRY_S = env.float("JOBS_DB_RETRY_S", default=120.0)
JOBS_FLUSH_ROWS = env.int("JOBS_FLUSH_ROWS", default=500)
JOBS_FLUSH_INTERVAL_S = env.float("JOBS_FLUSH_INTERVAL_S", default=0.5)
# Progress messages to the Channels layer, per job and worker, at most this many per second.
JOBS_PROGRESS_MAX_PER_S = env.float("JOBS_PROGRESS_MAX_PER_S", default=4.0)
# Model-server operations ("ops"; until they were renamed these three were ADMIN_QUEUE_ALERT_MS,
# ADMIN_ACTION_DEADLINE_S and ADMIN_ACTION_RESEND_MAX_AGE_S: the old variable names are still read, deprecated).
# The dashboard warns when an operation (pause, weight update...) waited longer than this on the
# client side (queue_ms = wall_ms - rpc_ms).
OPS_QUEUE_ALERT_MS = env.float("OPS_QUEUE_ALERT_MS", default=env.float("ADMIN_QUEUE_ALERT_MS", default=1000.0))
# Total deadlines of the endpoint tasks (Celery's time limits are not enforced under -P threads): a health check
# or pre-warm, and an ops action (its replicas are still told to resume when it is cut).
ENDPOINT_TASK_DEADLINE_S = env.float("ENDPOINT_TASK_DEADLINE_S", default=120.0)
OPS_ACTION_DEADLINE_S = env.float("OPS_ACTION_DEADLINE_S", default=env.float("ADMIN_ACTION_DEADLINE_S", default=1800.0))
# Redis back without its data: queued ops actions younger than this are sent again, older ones failed
OPS_ACTION_RESEND_MAX_AGE_S = env.float("OPS_ACTION_RESEND_MAX_AGE_S",
                                        default=env.float("ADMIN_ACTION_RESEND_MAX_AGE_S", default=300.0))

# --- Operator limits (controlplane.limits: one check for the dashboard, API, admin and CLI) ------
# Where the workers and the web process may call out (workers.outbound, built in controlplane/outbound.py): model
# servers, replicas, NeMo Gym servers, judges, remote verifiers, /stats. "*" (anything) on a laptop, a list in
# production: "vllm:8000", "vllm" (any port), ".gpu.internal" (a domain and its subdomains), "gym:11000-11100",
# "10.0.0.0/8:8000" (what a name resolves to). Link-local and cloud-metadata addresses are always refused;
# redirects are never followed; each call has a byte cap and a total deadline (defaults below).
ENDPOINT_ALLOWED_HOSTS = env.list("ENDPOINT_ALLOWED_HOSTS", default=["*"])
OUTBOUND_MAX_BYTES = env.int("OUTBOUND_MAX_BYTES", default=16 * 1024 * 1024)
OUTBOUND_TIMEOUT_S = env.float("OUTBOUND_TIMEOUT_S", default=60.0)
# Webhooks (controlplane.alerts): any public address; private / loopback ones only when named here (host,
# host:port or network). Each delivery: WEBHOOK_TIMEOUT_S in all, an answer read up to WEBHOOK_MAX_BYTES,
# WEBHOOK_MAX_ATTEMPTS tries (backoff WEBHOOK_RETRY_BASE_S x 4^n), from the control lane.
WEBHOOK_ALLOWED_HOSTS = env.list("WEBHOOK_ALLOWED_HOSTS", default=[])
WEBHOOK_TIMEOUT_S = env.float("WEBHOOK_TIMEOUT_S", default=5.0)
WEBHOOK_MAX_BYTES = env.int("WEBHOOK_MAX_BYTES", default=64 * 1024)
WEBHOOK_MAX_ATTEMPTS = env.int("WEBHOOK_MAX_ATTEMPTS", default=3)
WEBHOOK_RETRY_BASE_S = env.float("WEBHOOK_RETRY_BASE_S", default=2.0)
# Environment variables of the workers a judge may take its API key from (verifier option api_key_env). Users
# never name one otherwise: a judge's key comes from an endpoint they own (option endpoint).
JUDGE_API_KEY_ENVS = env.list("JUDGE_API_KEY_ENVS", default=[])
# NeMo Gym profile logs (stats_urls[].log) are read only under this directory (its profiling_results_dirpath,
# shared with the workers); unset: none is read.
PROFILING_STATS_LOG_DIR = env("PROFILING_STATS_LOG_DIR", default="")
ENDPOINT_MAX_REQUEST_TIMEOUT_S = env.float("ENDPOINT_MAX_REQUEST_TIMEOUT_S", default=3600.0)
ENDPOINT_MAX_CONNECT_TIMEOUT_S = env.float("ENDPOINT_MAX_CONNECT_TIMEOUT_S", default=300.0)
ENDPOINT_MAX_RETRIES = env.int("ENDPOINT_MAX_RETRIES", default=20)
JOBS_MAX_PARALLELISM = env.int("JOBS_MAX_PARALLELISM", default=4096)
JOBS_MAX_NUM_REPEATS = env.int("JOBS_MAX_NUM_REPEATS", default=10000)
JOBS_MAX_CHUNK_SIZE = env.int("JOBS_MAX_CHUNK_SIZE", default=1_000_000)
# Per user, over queued and running jobs and parallelism sweeps (a sweep counts its peak parallelism).
JOBS_MAX_ACTIVE_PER_USER = env.int("JOBS_MAX_ACTIVE_PER_USER", default=20)
JOBS_MAX_PARALLELISM_PER_USER = env.int("JOBS_MAX_PARALLELISM_PER_USER", default=8192)
# A parallelism sweep (diagnostics) is stopped at this total deadline and marked failed with the reason.
DIAGNOSTICS_SWEEP_DEADLINE_S = env.float("DIAGNOSTICS_SWEEP_DEADLINE_S", default=1800.0)
# Dataset rows shown (API rows, previews): a row longer than DATASET_ROW_MAX_CHARS (its JSON) comes as an excerpt,
# and a page of rows stops before DATASET_ROWS_MAX_CHARS.
DATASET_ROW_MAX_CHARS = env.int("DATASET_ROW_MAX_CHARS", default=1_000_000)
DATASET_ROWS_MAX_CHARS = env.int("DATASET_ROWS_MAX_CHARS", default=8_000_000)
# A model response larger than this is a failed attempt (bad_response), never read whole.
ENGINE_MAX_RESPONSE_BYTES = env.int("ENGINE_MAX_RESPONSE_BYTES", default=16 * 1024 * 1024)
# Several replicas (workers.engine.replicas): each run probes its replicas (GET /health; /v1/models for hosted
# APIs) every REPLICA_HEALTH_INTERVAL_S; a probe not answered within REPLICA_PROBE_TIMEOUT_S fails (a hung
# replica); a replica out of rotation is probed with backoff up to REPLICA_PROBE_MAX_S and put back when it answers.
REPLICA_HEALTH_INTERVAL_S = env.float("REPLICA_HEALTH_INTERVAL_S", default=5.0)
REPLICA_PROBE_TIMEOUT_S = env.float("REPLICA_PROBE_TIMEOUT_S", default=2.0)
REPLICA_PROBE_MAX_S = env.float("REPLICA_PROBE_MAX_S", default=10.0)
# The endpoint page's per-replica load sums the latest progress tick of every run seen in this window.
REPLICA_LOAD_WINDOW_S = env.float("REPLICA_LOAD_WINDOW_S", default=30.0)

# --- Cache: DRF throttles and django-axes counters, dashboard figures. Local memory on a laptop (one web
# process); production settings put it on Redis so several web processes share one set of limits.
CACHES = {"default": env.cache("CACHE_URL", default="locmemcache://")}

# --- Operators' metrics (controlplane.monitoring): GET /metrics for Prometheus, GET /healthz ----------
# Event counters are written by every web and worker process into this directory (prometheus-client's
# multi-process mode) and summed per scrape; empty it when the deployment starts, not while it runs.
# Processes on one host share it; each host's workers are scraped on their own (see README).
PROMETHEUS_MULTIPROC_DIR = env("PROMETHEUS_MULTIPROC_DIR", default=str(VAR_DIR / "prometheus"))
# Who may scrape: a request carrying "Authorization: Bearer <METRICS_TOKEN>", or a client address inside
# these networks (the real client's, through WEB_TRUSTED_PROXIES). Loopback only by default.
METRICS_TOKEN = env("METRICS_TOKEN", default="")
METRICS_ALLOWED_NETWORKS = env.list("METRICS_ALLOWED_NETWORKS", default=["127.0.0.0/8", "::1/128"])
# A worker on another machine serves its host's counters here (0: off; the web's /metrics has this host's).
WORKER_METRICS_PORT = env.int("WORKER_METRICS_PORT", default=0)
WORKER_METRICS_ADDR = env("WORKER_METRICS_ADDR", default="127.0.0.1")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        # Pub/sub channel names ignore the Redis database number: a prefix keeps deployments (and
        # test runs) that share one Redis apart.
        "CONFIG": {"hosts": [REDIS_URL], "prefix": env("CHANNELS_PREFIX", default="asgi")},
    }
}

# --- REST API ---------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "controlplane.rest.authentication.ExpiringTokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON with a bound on nesting (a 400, not a RecursionError).
    "DEFAULT_PARSER_CLASSES": ["controlplane.rest.parsers.JSONParser", "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Per token/user (anonymous: per IP); the token route has its own anonymous rate.
    # InFlightThrottle: at most API_USER_MAX_IN_FLIGHT of a user's requests open at once per web process.
    "DEFAULT_THROTTLE_CLASSES": ["controlplane.api.throttling.InFlightThrottle",
                                 "controlplane.api.throttling.UserRateThrottle"],
    # Throttles key anonymous requests on the real client address: X-Forwarded-For only as far as the
    # trusted proxies go (DRF's default, None, would take the client-supplied header as is).
    "NUM_PROXIES": WEB_TRUSTED_PROXIES,
    "DEFAULT_THROTTLE_RATES": {
        "user": env("API_THROTTLE_USER_RATE", default="1200/min"),
        "anon": env("API_THROTTLE_ANON_RATE", default="60/min"),
    },
}
# A user's share of a web process's pooled database connections (DB_POOL_MAX_SIZE): requests open at once,
# each counted until its answer is sent (controlplane.inflight). 0: no cap.
API_USER_MAX_IN_FLIGHT = env.int("API_USER_MAX_IN_FLIGHT", default=10)
# API tokens (django-rest-knox): hashed in the database, valid for API_TOKEN_TTL_DAYS from login, revocable
# (DELETE /api/auth/token/, or the admin). Sent as `Authorization: Token <token>` as before.
REST_KNOX = {
    "TOKEN_TTL": timedelta(days=env.float("API_TOKEN_TTL_DAYS", default=30.0)),
    "AUTO_REFRESH": False,
    "AUTH_HEADER_PREFIX": "Token",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Rollout control plane API",
    "DESCRIPTION": "Datasets, model endpoints and rollout collection jobs.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI and Redoc from drf-spectacular-sidecar (pinned, served locally), not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Every free-text string's schema says DRF refuses NUL characters (and lone surrogates).
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "controlplane.api.schema_hooks.strings_refuse_nul",
                             "controlplane.api.schema_hooks.at_least_one_of",
                             "controlplane.api.schema_hooks.partial_responses"],
    "ENUM_NAME_OVERRIDES": {"DatasetStatusEnum": "controlplane.datasets.models.Dataset.Status",
                            "RolloutStatusEnum": "controlplane.jobs.models.Rollout.Status",
                            "PauseModeEnum": "workers.ops.replicas.PAUSE_MODES",
                            "AdminOperationKindEnum": "controlplane.endpoints.models.AdminOperation.Kind",
                            "AdminActionStateEnum": "controlplane.endpoints.models.AdminAction.State",
                            "StateEnum": "controlplane.jobs.models.JobState"},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"},
                "axes.apps": {"level": "WARNING"}},  # its "AXES: BEGIN version ..." on every manage.py call
}
