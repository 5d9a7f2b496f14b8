#!/usr/bin/env bash
# Session 6 (development): how does the image's /opt/gcc/bin/g++ wrapper link libstdc++, and which link flags give a
# shared object that depends on the shared libstdc++ (no private copy)?
set -u
echo "== wrapper"; cat /opt/gcc/bin/g++ | head -n 60
python3 -c "import sysconfig as s; print({k: s.get_config_var(k) for k in ('CC','CXX','LDSHARED','LDCXXSHARED')})"
cd /tmp && printf '#include <sstream>\n#include <string>\nstd::string f(long v) { std::ostringstream s; s << v; return s.str(); }\n' > x.cpp
try() {
  local name=$1; shift
  "$@" > /tmp/l.log 2>&1 || { echo "$name: link failed: $(head -c 300 /tmp/l.log)"; return; }
  echo "$name: NEEDED $(readelf -d $name.so | grep NEEDED | sed -n 's/.*\[\(.*\)\]/\1/p' | tr '\n' ' ') private $(nm -C --defined-only $name.so | grep -cE 'std::locale::classic\(\)$')"
}
W=/opt/gcc/bin/g++
try a $W -shared -fPIC x.cpp -o a.so
try b $W -shared -fPIC x.cpp -o b.so -lstdc++
try c $W -shared -fPIC x.cpp -o c.so -Wl,--no-as-needed -l:libstdc++.so.6
try d $W -shared -fPIC x.cpp -o d.so -Wl,-Bdynamic -lstdc++
try e /usr/bin/g++ -shared -fPIC x.cpp -o e.so
try f $W -shared -fPIC -shared-libgcc x.cpp -o f.so -Wl,-Bdynamic -l:libstdc++.so.6
$W -shared -fPIC x.cpp -o v.so -v 2>&1 | grep -E "collect2|ld " | tail -n 1 | tr ' ' '\n' | grep -E "stdc|static|Bdyn|Bstat|as-needed" | head
