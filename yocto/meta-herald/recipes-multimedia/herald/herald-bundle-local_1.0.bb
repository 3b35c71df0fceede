# nooelint: oelint.var.bbclassextend
# (bbclassextend: a model bundle is data for the target only.)
SUMMARY = "A herald model bundle from a local directory"
DESCRIPTION = "Installs an exported herald model bundle (bundle.toml, ONNX step graphs, \
               tables and tokenizer; see herald's docs/bundle.md) from the directory named \
               by HERALD_BUNDLE_DIR into /usr/share/herald/bundles/default, where herald \
               looks by default."
# The homepage check needs the network, and the URL is a placeholder (see herald_0.1.0.bb).
# nooelint: oelint.vars.homepageping
HOMEPAGE = "https://example.invalid/herald"
BUGTRACKER = "https://example.invalid/herald/issues"
SECTION = "multimedia"
# The Qwen3-TTS 12 Hz checkpoints are published under Apache-2.0, and herald's tiny random
# test bundles are herald's own (Apache-2.0). A bundle under other terms needs LICENSE set to
# match in a bbappend. A bundle directory holds no license file, hence oe-core's copy of the
# text.
LICENSE = "Apache-2.0"
# nooelint: oelint.var.licenseremotefile
LIC_FILES_CHKSUM = "file://${COMMON_LICENSE_DIR}/Apache-2.0;md5=89aea4e17d99a7cacdbeed46a0096b10"

# An absolute path to an exported bundle, set in local.conf, e.g.
#   HERALD_BUNDLE_DIR = "/srv/herald/bundles/0.6b"
# (tools/export/export export --checkpoint ... --out /srv/herald/bundles/0.6b).
HERALD_BUNDLE_DIR ??= ""

# file:// of an absolute directory: bitbake checksums every file, so a re-exported bundle is
# picked up; it unpacks under its full path inside UNPACKDIR.
SRC_URI = "${@'file://' + d.getVar('HERALD_BUNDLE_DIR') if d.getVar('HERALD_BUNDLE_DIR') else ''}"

S = "${UNPACKDIR}${HERALD_BUNDLE_DIR}"

inherit allarch

CVE_PRODUCT = ""

do_configure[noexec] = "1"
do_compile[noexec] = "1"

do_install() {
    if [ ! -f ${S}/bundle.toml ]; then
        bbfatal "HERALD_BUNDLE_DIR=${HERALD_BUNDLE_DIR} holds no bundle.toml: not a herald bundle"
    fi
    install -d ${D}${datadir}/herald/bundles/default
    cp -R --no-dereference --preserve=mode,links ${S}/. ${D}${datadir}/herald/bundles/default/
    chmod -R u=rwX,go=rX ${D}${datadir}/herald/bundles/default
}

# Without a bundle there is nothing to package: skip the recipe with a reason instead of
# failing in do_fetch. The check must run at parse time, which only anonymous python can do.
# nooelint: oelint.task.noanonpython
python () {
    if not d.getVar('HERALD_BUNDLE_DIR'):
        raise bb.parse.SkipRecipe("set HERALD_BUNDLE_DIR to an exported herald bundle directory")
}

# One package holding the whole bundle: the default FILES would split it by file type
# (e.g. nothing of datadir/herald belongs in -dev or -doc).
# nooelint: oelint.var.filesoverride
FILES:${PN} = "${datadir}/herald/bundles/default"
