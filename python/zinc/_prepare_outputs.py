"""zinc.prepare's outputs: the four files of a set written to temporaries and committed in RENAME_ORDER (Outputs,
the .bin's header with the set record), the prefix's lock (PrefixLock), the removal of dead runs' temporaries,
the test hook fault_point (ZINC_PREPARE_FAULT), and the checks that --out names a file prefix and that no
output is a file the run reads (by device and inode). See prepare.py for the tool and the commit's rules."""
from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import re
import signal
import stat
import struct
import sys
import zlib
from typing import BinaryIO, Optional

from ._prepare_common import PrepareError

HEADER_INTS = 256
SET_MARKER = 0x434E495A  # header[3]: the bytes "ZINC" in file order; header[4..10] then record the set
SET_VERSION = 1  # header[4]: the version of that record
TOKENS_CRC_MARKER = 0x43524354  # header[12]: the bytes "TCRC" in file order; header[13] then holds the tokens' CRC-32
OUTPUT_EXTENSIONS = ("bin", "mask", "docs", "json")
# The data's commit point is the .bin (its header vouches for the .mask and .docs); the manifest, whose old
# version is removed before the first rename, comes after it: a manifest present always describes the .bin.
RENAME_ORDER = ("mask", "docs", "bin", "json")
TOKEN_FORMATS = {"uint16": (20240520, 1, "H"), "uint32": (20240801, 7, "I")}  # magic, version, array typecode


def fault_point(phase: str) -> None:
    """Test hook (tests/tools/crash_prepare.py), as the engine's ZINC_CHECKPOINT_FAULT: ZINC_PREPARE_FAULT=PHASE
    kills this process with SIGKILL, as kill -9 would, at PHASE: "writing" (the first batch is in the
    temporaries), "before_rename" (the four temporaries complete and fsynced, none renamed), "after_mask",
    "after_docs", "after_bin" (that file renamed into place, those after it in RENAME_ORDER not yet; the old
    manifest already removed), "after_manifest" (all four renamed, the folder not yet fsynced). Nothing when
    unset or another phase."""
    if os.environ.get("ZINC_PREPARE_FAULT") == phase:
        os.kill(os.getpid(), signal.SIGKILL)


RENAME_FAULTS = {"mask": "after_mask", "docs": "after_docs", "json": "after_manifest", "bin": "after_bin"}


def check_out_prefix(out: str) -> str:
    """The absolute --out prefix; a PrepareError when it names no file (empty, a folder's path, . or ..)."""
    if os.path.basename(out) in ("", ".", ".."):
        raise PrepareError(f"--out {out!r} is not a file prefix: give one such as data/sft (the outputs are "
                           "PREFIX.bin, PREFIX.mask, PREFIX.docs and PREFIX.json)")
    prefix = os.path.abspath(out)
    # The manifest's data section names the files in JSON, which holds
    # only UTF-8: a path of other bytes (surrogate-escaped here) would be
    # written, then refused by zinc-train as a JSON syntax error.
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        raise PrepareError(f"--out {out!r} is not valid UTF-8: a zinc config (JSON) cannot name its files; "
                           "choose a UTF-8 name") from None
    folder = os.path.dirname(prefix)
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise PrepareError(f"{folder}: not a folder (the --out prefix's folder must be one)")
        raise PrepareError(f"{folder}: no such folder (the --out prefix's folder must exist)")
    return prefix


def output_paths(prefix: str) -> dict:
    """Every path a run on the prefix writes: the four outputs, their temporaries (.BASENAME.EXT.tmp-PID) and
    the lock file (.BASENAME.lock), all in the prefix's folder."""
    folder, base = os.path.split(prefix)
    paths = {ext: f"{prefix}.{ext}" for ext in OUTPUT_EXTENSIONS}
    paths.update({f"{ext}.tmp": os.path.join(folder, f".{base}.{ext}.tmp-{os.getpid()}") for ext in OUTPUT_EXTENSIONS})
    paths["lock"] = os.path.join(folder, f".{base}.lock")
    return paths


def _identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of the file a path resolves to (symlinks followed), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_apart(prefix: str, reads: list[tuple[str, str]]) -> None:
    """Refuses, before anything is written, an output that is a file the run reads: (what, path) of each
    input, the tokenizer's files. Files are compared by device and inode of the resolved path, never by name:
    a symlink, a hard link or another spelling of the path is the same file. An output that is a folder is
    refused too (it could not be replaced)."""
    read_ids = {}
    for what, path in reads:
        if (i := _identity(path)) is not None:
            read_ids.setdefault(i, (what, path))
    for key, path in output_paths(prefix).items():
        if key in OUTPUT_EXTENSIONS and os.path.isdir(path):
            raise PrepareError(f"{path}: is a folder, where --out writes a file; choose another --out")
        if (i := _identity(path)) in read_ids:
            what, source = read_ids[i]
            raise PrepareError(f"--out would overwrite the {what} {source}: {path} is that file; choose another --out")
    # The manifest's name is another tool's file's where --out ends in one of its names (--out m.safetensors.index
    # writes m.safetensors.index.json, a sharded export's index): replaced only when it is a zinc.prepare manifest.
    manifest = output_paths(prefix)["json"]
    if os.path.isfile(manifest) and not _is_manifest(manifest):
        raise PrepareError(f"{manifest}: is not a zinc.prepare manifest (a file of yours, or another tool's: a "
                           "safetensors index?), and --out replaces it; choose another --out")


def _is_manifest(path: str) -> bool:
    """Whether path holds a zinc.prepare manifest (a JSON object whose format is zinc.prepare/N)."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and (str(doc.get("format", "")).startswith("zinc.prepare/") or
                                      (isinstance(doc.get("files"), dict) and "tokens" in doc["files"]))


def _alive(pid: int) -> bool:
    """Whether a process of that id runs (one of another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


class PrefixLock:
    """The run's exclusive hold on an output prefix: flock on FOLDER/.BASENAME.lock (created, holding the pid;
    removed at the end), non-blocking: a second run on the same --out at once is refused naming the pid that
    holds it. Once held, the temporaries runs on the prefix left when killed (.BASENAME.EXT.tmp-PID of a PID
    that is no live process) are removed."""

    def __init__(self, prefix: str, reads: list[tuple[str, str]]):
        self.prefix = prefix
        self.path = output_paths(prefix)["lock"]
        self.fd: Optional[int] = None
        self._acquire()
        try:
            self.removed = remove_dead_temporaries(prefix, {_identity(p) for _, p in reads})
        except BaseException:
            self.release()
            raise

    def _acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device put there: not a lock to write
                os.close(fd)
                raise PrepareError(f"{self.path}: the --out prefix's lock file is not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                raise PrepareError(f"{self.path}: another zinc.prepare (pid {holder or 'unknown'}) is writing "
                                   f"{self.prefix}.{{bin,mask,docs,json}}; wait for it to end or choose another --out")
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                    raise
                print(f"zinc.prepare: warning: {self.path}: cannot lock ({e.strerror}): a second run on this --out "
                      "at once would not be refused", file=sys.stderr)
                return
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == _identity(self.path):
                break
            os.close(fd)  # the run that held it removed the file in between: lock the one now there
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Removes the lock file, while still holding it, then lets it go."""
        if self.fd is None:
            return
        st = os.fstat(self.fd)
        if (st.st_dev, st.st_ino) == _identity(self.path):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None


def remove_dead_temporaries(prefix: str, keep: set) -> list[str]:
    """Removes the temporaries of the prefix (.BASENAME.EXT.tmp-PID in its folder) whose PID is no live process:
    what a run killed before its renames left. Those of a live process are left, and so is a file the run reads
    (by its identity in keep). Returns the paths removed."""
    folder, base = os.path.split(prefix)
    pattern = re.compile(r"\.%s\.(?:%s)\.tmp-(\d+)" % (re.escape(base), "|".join(OUTPUT_EXTENSIONS)))
    removed = []
    for name in sorted(os.listdir(folder)):
        m = pattern.fullmatch(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) or _identity(path) in keep:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _create(path: str) -> BinaryIO:
    """A new file at path, opened to write: whatever was there (a temporary of an earlier process that had this
    pid) is removed first, so that nothing is written through a symlink."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), "wb")


def _naming(e: OSError, doing: str, path: str) -> OSError:
    """The OSError `e` (a full disk's ENOSPC, ulimit -f's EFBIG: no file named) as one that names `path`."""
    if e.filename:
        return e
    return OSError(e.errno, f"cannot {doing} {path}: {e.strerror}")


class Outputs:
    """PREFIX.{bin,mask,docs} written under temporary names (.BASENAME.EXT.tmp-PID, in the prefix's folder), with
    the CRC-32 and size of the mask and documents counted on the way; commit() writes the .bin's header and the
    manifest, fsyncs the four and renames them into place, the .bin last; discard() removes whatever is left.
    The caller holds the prefix's PrefixLock."""

    def __init__(self, prefix: str, token_dtype: str):
        self.prefix = os.path.abspath(prefix)
        paths = output_paths(self.prefix)
        self.final = {ext: paths[ext] for ext in OUTPUT_EXTENSIONS}
        self.temp = {ext: paths[f"{ext}.tmp"] for ext in OUTPUT_EXTENSIONS}
        self.magic, self.version, self.typecode = TOKEN_FORMATS[token_dtype]
        self.files: dict = {}
        self.tokens = 0
        self.documents = 0
        self.masked = 0
        self.padding_documents = 0  # of self.documents, --pack rows' padding
        self.row_tokens = 0  # --pack rows: the rows' seq_len (header word 11)
        self.crc = {"tokens": 0, "mask": 0, "documents": 0}  # zlib.crc32 of the .bin after its header, .mask, .docs
        self.bytes = {"tokens": 0, "mask": 0, "documents": 0}
        try:
            for ext in ("bin", "mask", "docs"):
                self.files[ext] = _create(self.temp[ext])
        except BaseException:
            self.discard()
            raise
        self.files["bin"].write(bytes(4 * HEADER_INTS))  # the header is written at commit, with the count

    def add(self, docs: list[tuple[list, Optional[bytearray]]]) -> None:
        """Appends documents: (token ids, mask or None for all 1), one write per file."""
        tokens, starts, mask = array.array(self.typecode), array.array("Q"), bytearray()
        for ids, m in docs:
            starts.append(self.tokens + len(tokens))
            tokens.extend(ids)
            mask += b"\x01" * len(ids) if m is None else m
            if m is not None and 1 not in m:  # --pack rows' padding: no record has no label
                self.padding_documents += 1
        for key, ext, data in (("tokens", "bin", _little_endian(tokens).tobytes()), ("mask", "mask", mask),
                               ("documents", "docs", _little_endian(starts).tobytes())):
            try:
                self.files[ext].write(data)
            except OSError as e:  # a full disk (ENOSPC) or ulimit -f (EFBIG) names no file by itself
                raise _naming(e, "write", self.temp[ext]) from e
            self.crc[key] = zlib.crc32(data, self.crc[key])
            self.bytes[key] += len(data)
        self.tokens += len(tokens)
        self.documents += len(starts)
        self.masked += len(mask) - mask.count(1)
        fault_point("writing")

    def header(self) -> bytes:
        """The .bin's 256 little-endian int32s: llm.c's magic, version and token count, then the set record
        zinc-train checks the .mask and .docs beside it against: [3] SET_MARKER, [4] SET_VERSION, [5] the
        .mask's CRC-32 (its uint32 bit pattern), [6] and [7] the low and high 32 bits of its size in bytes,
        [8], [9] and [10] the same of the .docs, [11] the seq_len of --pack rows' rows (0: a stream; readers
        of the record's version 1 before it ignore the word), [12] TOKENS_CRC_MARKER and [13] the CRC-32 of the
        tokens after the header, which zinc-train checks in the pass over the tokens it makes at every open
        (readers before it ignore both words); the rest 0."""
        if self.tokens > 0x7FFFFFFF:
            raise PrepareError(f"{self.tokens:,} tokens: more than llm.c's header counts (2**31 - 1); split the "
                               "data set into several --out")
        ints = [self.magic, self.version, self.tokens, SET_MARKER, SET_VERSION]
        for key in ("mask", "documents"):
            ints += [self.crc[key], self.bytes[key] & 0xFFFFFFFF, self.bytes[key] >> 32]
        ints.append(self.row_tokens)  # [11]: --pack rows' row length (the seq_len), 0 when packed as a stream
        ints += [TOKENS_CRC_MARKER, self.crc["tokens"]]  # [12], [13]
        return struct.pack(f"<{HEADER_INTS}I", *ints, *[0] * (HEADER_INTS - len(ints)))

    def commit(self, manifest: dict) -> None:
        """Writes the header and the manifest, fsyncs the four temporaries, removes the old manifest and renames
        them in RENAME_ORDER: the .mask, the .docs, the .bin, the data's commit point (its header vouches for
        the .mask and .docs by CRC-32 and size, so a set a kill left mixed is refused by zinc-train, not trained
        on), and the manifest last (one present always describes the .bin beside it). The folder is fsynced
        before the .bin's rename and after it."""
        try:
            self.files["bin"].seek(0)
            self.files["bin"].write(self.header())
        except OSError as e:
            raise _naming(e, "write", self.temp["bin"]) from e
        try:
            with _create(self.temp["json"]) as f:
                f.write(json.dumps(manifest, indent=2).encode("utf-8") + b"\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise _naming(e, "write", self.temp["json"]) from e
        for ext, f in self.files.items():
            try:  # what was buffered goes out here: a full disk shows at the flush
                f.flush()
                os.fsync(f.fileno())
                f.close()
            except OSError as e:
                raise _naming(e, "write", self.temp[ext]) from e
        fault_point("before_rename")
        folder = os.path.dirname(self.prefix)
        try:  # a manifest present always describes the .bin beside it: the old one goes before any rename
            os.unlink(self.final["json"])
        except FileNotFoundError:
            pass
        for ext in RENAME_ORDER:
            if ext == "bin":
                _fsync_path(folder)
            os.replace(self.temp[ext], self.final[ext])
            fault_point(RENAME_FAULTS[ext])
        _fsync_path(folder)

    def discard(self) -> None:
        for f in self.files.values():
            try:
                f.close()  # flushes what is buffered: on a full disk that fails again
            except OSError:
                pass
        for path in self.temp.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _little_endian(a: array.array) -> array.array:
    if sys.byteorder != "little":
        a.byteswap()
    return a
