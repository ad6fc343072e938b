#!/usr/bin/env bash
# install_paths.sh -- after `make install`: when the install directories are not where LuaJIT
# (and the shell) look by default, print the lines that make them so. Reads LUADIR, LIBDIR,
# BINDIR and LUAJIT from the environment (the Makefile passes them).
set -u
luajit="${LUAJIT:-luajit}"
lpath="$LUADIR/?.lua;$LUADIR/?/init.lua"
cpath="$LIBDIR/?.so"
# LuaJIT's own defaults, not the caller's LUA_PATH/LUA_CPATH
defaults="$(env -u LUA_PATH -u LUA_CPATH "$luajit" -e 'print(package.path); print(package.cpath)' 2>/dev/null)"
lines=()
case ";$(echo "$defaults" | sed -n 1p);" in *";$LUADIR/?.lua;"*) ;; *) lines+=("export LUA_PATH=\"$lpath;;\"") ;; esac
case ";$(echo "$defaults" | sed -n 2p);" in *";$cpath;"*) ;; *) lines+=("export LUA_CPATH=\"$cpath;;\"") ;; esac
case ":$PATH:" in *":$BINDIR:"*) ;; *) lines+=("export PATH=\"$BINDIR:\$PATH\"") ;; esac
echo "fsdp: installed (Lua modules in $LUADIR, libraries in $LIBDIR, commands in $BINDIR)"
if [ ${#lines[@]} -gt 0 ]; then
  echo "fsdp: LuaJIT does not look there by default; add these lines to your shell profile:"
  printf '  %s\n' "${lines[@]}"
fi
