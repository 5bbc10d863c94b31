#!/usr/bin/env bash
# Start Redis and PostgreSQL for the servers-mode tests when they are not running already.
set -u
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  echo "starting redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! pg_isready -h 127.0.0.1 -q 2>/dev/null; then
  echo "starting postgresql"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
for _ in $(seq 1 50); do
  redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && pg_isready -h 127.0.0.1 -q && exit 0
  sleep 0.2
done
echo "Redis or PostgreSQL did not come up" >&2
exit 1
