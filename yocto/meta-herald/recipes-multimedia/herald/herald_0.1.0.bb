# nooelint: oelint.var.bbclassextend
# (bbclassextend: herald is an appliance binary for the target; a native or nativesdk
# variant has no use.)
SUMMARY = "On-device Qwen3-TTS text to speech for speaking appliances"
DESCRIPTION = "herald turns text into speech on the device with the Qwen3-TTS 12 Hz \
               models and plays it through ALSA. This recipe builds the herald binary and \
               installs its systemd service (herald serve, which speaks each line written \
               to /run/herald/say) and its configuration /etc/herald/herald.toml. The model \
               bundle comes from a herald-bundle-* recipe."
# example.invalid is the placeholder Cargo.toml's `repository` uses too; oelint-adv's
# homepage check needs the network, which CI does not have, and cannot pass for it.
# nooelint: oelint.vars.homepageping
HOMEPAGE = "https://example.invalid/herald"
BUGTRACKER = "https://example.invalid/herald/issues"
SECTION = "multimedia"
# The repository's LICENSE is the Apache License 2.0 text as published by the ASF
# (https://www.apache.org/licenses/LICENSE-2.0.txt), which Cargo.toml declares. The binary
# also links LAME (the mp3 encoder, LGPL-2.0-or-later per its COPYING and source headers) and
# its Rust bindings mp3lame-sys and mp3lame-encoder (LGPL-3.0 per their crate metadata)
# statically: docs/licences.md says what that asks of whoever ships the image. Their source
# comes in crates, not in ${S}, hence oe-core's copies of the texts.
LICENSE = "Apache-2.0 & LGPL-2.0-or-later & LGPL-3.0-only"
LIC_FILES_CHKSUM = "file://LICENSE;md5=3b83ef96387f14655fc854ddc3c6bd57 \
                    file://${COMMON_LICENSE_DIR}/LGPL-2.0-or-later;md5=6d2d9952d88b50a51a5c73dc431d06c7 \
                    file://${COMMON_LICENSE_DIR}/LGPL-3.0-only;md5=bfccfe952269fff2b407dd11f2f3083b"

# alsa-lib: the `alsa` crate links it. cmake-native: opusic-sys builds libopus (the opus
# encoder, BSD-3-Clause, linked statically like LAME) from its C source with CMake.
DEPENDS += "alsa-lib cmake-native"

PV .= "+git"

# The git URL is a placeholder (see HOMEPAGE): point it and SRCREV at herald's real
# repository in a bbappend, or build a checkout with externalsrc (README.md).
SRC_URI = "git://example.invalid/herald.git;protocol=https;branch=main"
# This layer lives in herald's own repository, so a pinned SRCREV would always name an older
# commit than the one holding it (and herald-crates.inc, kept in step with that commit's
# Cargo.lock by yocto/update-crates). Release branches pin SRCREV to the release commit.
# nooelint: oelint.vars.autorev
SRCREV = "${AUTOREV}"

inherit cargo cargo-update-recipe-crates pkgconfig systemd

require ${BPN}-crates.inc

CVE_PRODUCT = "herald"

# herald's release profile strips the binary; let OE strip it so that herald-dbg has symbols
# (and the "already-stripped" QA check passes).
export CARGO_PROFILE_RELEASE_STRIP = "false"

# The unit and the configuration come from the repository's rootfs overlay (image/overlay),
# the single source shared with the QEMU test image.
do_install:append() {
    install -d ${D}${systemd_system_unitdir}
    install -m 0644 ${S}/image/overlay/lib/systemd/system/herald.service ${D}${systemd_system_unitdir}/herald.service
    install -m 0644 ${S}/image/overlay/lib/systemd/system/herald.socket ${D}${systemd_system_unitdir}/herald.socket
    install -d ${D}${sysconfdir}/herald
    install -m 0644 ${S}/image/overlay/etc/herald/herald.toml ${D}${sysconfdir}/herald/herald.toml
    install -d ${D}${docdir}/${BPN}
    install -m 0644 ${S}/image/overlay/etc/asound.conf ${D}${docdir}/${BPN}/asound.conf.example
}

# Optional: the talker and code predictor on a Snapdragon NPU (herald's docs/backend.md).
# herald opens the QNN runtime with dlopen when runtime.backend picks it, so the binary is the
# same either way (no link dependency); this only makes the image carry the vendor's runtime,
# which herald never ships. It comes from the BSP (e.g. meta-qcom-robotics-sdk's qti-qnn, which
# installs libQnnHtp.so, libQnnSystem.so and the HTP stub/skel libraries into /usr/lib); set
# HERALD_QNN_RUNTIME to your BSP's package and enable it with
#   PACKAGECONFIG:append:pn-herald = " qnn"
HERALD_QNN_RUNTIME ?= "qti-qnn"
PACKAGECONFIG ??= ""
PACKAGECONFIG[qnn] = ",,,${HERALD_QNN_RUNTIME}"

SYSTEMD_SERVICE:${PN} = "herald.socket herald.service"

CONFFILES:${PN} = "${sysconfdir}/herald/herald.toml"

# /etc/asound.conf belongs to alsa-state or the BSP (e.g. meta-tegra's tegra-configs-alsa);
# herald ships its example as documentation (herald-doc) only.
RRECOMMENDS:${PN} = "alsa-utils-aplay"
